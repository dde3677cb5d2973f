//! The executable image's start-up pages. Start-up (argument and config parsing, TLS and CA
//! set-up, the first xDS or ZDS exchange, and the static-PIE binary's own relocation pass over
//! `.rela.dyn`) reads code and constants that a running proxy never touches again, and the
//! kernel maps file pages around every fault in 64 KiB steps: a ready `ztnode proxy` with two
//! pods had 9.9 of its 11.7 MiB RSS in the binary's read-only pages, most of them start-up only.
//! (The release binary's code layout, `layout/symbol-order.txt`, keeps the pages a running proxy
//! uses together; `build.rs`.)
//!
//! [`release_startup_pages`] unmaps the clean read-only file mappings of the executable once
//! (`madvise(MADV_DONTNEED)`, madvise(2)): a later access refaults the page from the page cache,
//! as after any reclaim, so only what the running process uses stays mapped, and the rest is
//! ordinary, reclaimable page cache instead of mapped executable pages.

use std::path::{Path, PathBuf};

/// Why the pages could not be released.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// `/proc/self/exe` or `/proc/self/smaps` could not be read.
    #[error("reading {path}: {source}")]
    Proc {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The kernel refused the advice for a mapping.
    #[error("madvise of {len} bytes at {addr:#x}: {source}")]
    Madvise {
        /// Start of the mapping.
        addr: usize,
        /// Its length in bytes.
        len: usize,
        /// Cause.
        source: nix::Error,
    },
}

/// One mapping of `/proc/self/smaps` (proc(5)): its range, permissions, path, and its resident,
/// anonymous (copy-on-write modified) and swapped sizes in KiB.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    start: usize,
    end: usize,
    perms: String,
    path: String,
    rss_kib: u64,
    anon_kib: u64,
    swap_kib: u64,
}

impl Mapping {
    /// Whether dropping its pages loses nothing: a private mapping of `exe` that is not writable
    /// and holds no modified page, resident (`Anonymous`) or swapped out (`Swap`: a private
    /// mapping's swapped pages are modified ones), so every page refaults unchanged from the file.
    /// A read-only mapping with modified pages (a RELRO region after relocation) is left alone.
    fn is_clean_image_of(&self, exe: &str) -> bool {
        let p = self.perms.as_bytes();
        self.path == exe
            && p.len() == 4
            && p[0] == b'r'
            && p[1] != b'w'
            && p[3] == b'p'
            && self.start < self.end
            && self.anon_kib == 0
            && self.swap_kib == 0
    }
}

/// Parses `/proc/self/smaps` text into its mappings; lines it does not know are skipped.
fn parse_smaps(text: &str) -> Vec<Mapping> {
    let mut maps: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(start), Ok(end)) =
                (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            let perms = fields.next().unwrap_or_default().to_string();
            // offset, device, inode, then the path (which may hold spaces)
            let path = fields.skip(3).collect::<Vec<_>>().join(" ");
            maps.push(Mapping {
                start,
                end,
                perms,
                path,
                rss_kib: 0,
                // unknown until their lines: not clean
                anon_kib: u64::MAX,
                swap_kib: u64::MAX,
            });
            continue;
        }
        let mut kib = || fields.next().and_then(|v| v.parse::<u64>().ok());
        match (first, maps.last_mut()) {
            ("Rss:", Some(m)) => m.rss_kib = kib().unwrap_or(0),
            ("Anonymous:", Some(m)) => m.anon_kib = kib().unwrap_or(u64::MAX),
            ("Swap:", Some(m)) => m.swap_kib = kib().unwrap_or(u64::MAX),
            _ => {}
        }
    }
    maps
}

/// The file's text; bytes that are not UTF-8 (a mapped path can hold any) are replaced.
fn read(path: &Path) -> Result<String, ImageError> {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .map_err(|source| ImageError::Proc {
            path: path.to_owned(),
            source,
        })
}

/// Unmaps the resident pages of the executable's clean read-only mappings (text, constants,
/// headers and relocations) and returns how many KiB were resident in them. Call it once, when
/// the role is ready; the pages it then uses refault (minor faults, from the page cache). Errors:
/// `/proc/self` unreadable, or madvise failed (the pages stay mapped; nothing is lost).
pub fn release_startup_pages() -> Result<u64, ImageError> {
    let exe_link = Path::new("/proc/self/exe");
    let exe = std::fs::read_link(exe_link).map_err(|source| ImageError::Proc {
        path: exe_link.to_owned(),
        source,
    })?;
    let exe = exe.to_string_lossy();
    let maps = parse_smaps(&read(Path::new("/proc/self/smaps"))?);
    let mut released = 0;
    for m in maps.iter().filter(|m| m.is_clean_image_of(&exe)) {
        dont_need(m.start, m.end - m.start)?;
        released += m.rss_kib;
    }
    Ok(released)
}

#[allow(unsafe_code)]
fn dont_need(addr: usize, len: usize) -> Result<(), ImageError> {
    let Some(ptr) = std::ptr::NonNull::new(addr as *mut std::ffi::c_void) else {
        return Ok(());
    };
    // SAFETY: the range is one whole mapping of the executable that is private, not writable and
    // holds no modified page (checked from smaps just before; nothing in this process makes it
    // writable). MADV_DONTNEED on such a mapping only drops page-table entries: every later
    // access refaults the same bytes from the file, so no value Rust code can observe changes.
    unsafe { nix::sys::mman::madvise(ptr, len, nix::sys::mman::MmapAdvise::MADV_DONTNEED) }
        .map_err(|source| ImageError::Madvise { addr, len, source })
}

/// Waits until `ready` has no pending task, then releases the start-up pages once and logs how
/// much was resident (info; a failure is a warning, the process keeps running as it was).
pub async fn release_when_ready(ready: crate::ready::Readiness) {
    ready.wait_ready().await;
    match release_startup_pages() {
        Ok(kib) => tracing::info!(kib, "released the start-up pages of the executable"),
        Err(e) => tracing::warn!(error = %e, "could not release the start-up pages"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0000000-55d0c0098000 r--p 00000000 fe:00 10018925                   /usr/local/bin/zt node
Size:                608 kB
Rss:                 608 kB
Anonymous:             0 kB
Swap:                  0 kB
55d0c0098000-55d0c0ef9000 r-xp 00098000 fe:00 10018925                   /usr/local/bin/zt node
Rss:                8120 kB
Anonymous:             0 kB
Swap:                  0 kB
VmFlags: rd ex mr mw me
55d0c0ef9000-55d0c0f00000 r--p 00ef9000 fe:00 10018925                   /usr/local/bin/zt node
Rss:                  28 kB
Anonymous:            12 kB
Swap:                  0 kB
55d0c0f00000-55d0c0f10000 r--p 00f00000 fe:00 10018925                   /usr/local/bin/zt node
Rss:                   0 kB
Anonymous:             0 kB
Swap:                 64 kB
55d0c0f10000-55d0c0f79000 rw-p 00f10000 fe:00 10018925                   /usr/local/bin/zt node
Rss:                 484 kB
Anonymous:           476 kB
Swap:                  0 kB
7f0000000000-7f0000021000 r--p 00000000 fe:00 77                         /usr/lib/libc.so.6
Rss:                  16 kB
Anonymous:             0 kB
Swap:                  0 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Rss:                  12 kB
Anonymous:            12 kB
Swap:                  0 kB
";

    #[test]
    fn only_the_executables_clean_read_only_mappings_are_released() {
        let maps = parse_smaps(SMAPS);
        assert_eq!(maps.len(), 7);
        assert_eq!(maps[0].path, "/usr/local/bin/zt node");
        assert_eq!((maps[1].rss_kib, maps[1].anon_kib), (8120, 0));
        let clean: Vec<usize> = maps
            .iter()
            .filter(|m| m.is_clean_image_of("/usr/local/bin/zt node"))
            .map(|m| m.start)
            .collect();
        // not the relocated read-only pages (modified, in memory or swapped out), not the data,
        // not libc or the stack
        assert_eq!(clean, [0x55d0c0000000, 0x55d0c0098000]);
    }

    #[test]
    fn a_mapping_without_its_anonymous_or_swap_line_is_not_taken_for_clean() {
        let no_swap = "1000-2000 r-xp 00000000 fe:00 1 /bin/x\nRss: 4 kB\nAnonymous: 0 kB\n";
        let no_anon = "1000-2000 r-xp 00000000 fe:00 1 /bin/x\nRss: 4 kB\nSwap: 0 kB\n";
        for text in [no_swap, no_anon] {
            assert!(!parse_smaps(text)[0].is_clean_image_of("/bin/x"), "{text}");
        }
    }

    /// Resident KiB of this test binary's first mapping (file offset 0: ELF headers and
    /// relocations with GNU ld), which nothing reads after start-up, unlike the code, which this
    /// test's own reading of smaps refaults.
    fn headers_rss_kib() -> u64 {
        let exe = std::fs::read_link("/proc/self/exe").expect("exe");
        let exe = exe.to_string_lossy();
        let text = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        parse_smaps(&text)
            .iter()
            .find(|m| m.is_clean_image_of(&exe))
            .map(|m| m.rss_kib)
            .expect("a clean mapping of the test binary")
    }

    /// 256 KiB of constants in the binary's read-only data.
    static TABLE: [u8; 256 * 1024] = {
        let mut t = [0u8; 256 * 1024];
        let mut i = 0;
        while i < t.len() {
            t[i] = (i * 31 % 251) as u8;
            i += 1;
        }
        t
    };

    fn checksum(t: &[u8]) -> u64 {
        t.iter().enumerate().fold(0u64, |a, (i, b)| {
            a.wrapping_mul(31).wrapping_add(*b as u64 ^ i as u64)
        })
    }

    #[test]
    fn releasing_unmaps_the_image_and_the_constants_refault_unchanged() {
        let sum = checksum(std::hint::black_box(&TABLE));
        let before = headers_rss_kib();
        let released = release_startup_pages().expect("release");
        assert!(released >= before && before > 0, "released {released} KiB");
        let after = headers_rss_kib();
        assert!(
            after * 2 <= before,
            "first image mapping {before} KiB resident before, {after} KiB after"
        );
        assert_eq!(checksum(std::hint::black_box(&TABLE)), sum);
    }
}
