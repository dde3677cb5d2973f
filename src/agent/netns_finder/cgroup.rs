//! Pod UID from `/proc/<pid>/cgroup` (spec §3.6; the SPIRE-derived matcher of istio-cni's
//! `podcgroupns_linux.go`).
//!
//! Each line is `hierarchy-id:controllers:path` (cgroup v1: one line per hierarchy; v2: `0::path`).
//! After a trailing `.scope` is cut, a path names a pod when it contains, after a punctuation
//! character, `pod` + a UID (32 hex digits in groups of 8-4-4-4-12, each separator one optional
//! punctuation character: `-` for cgroupfs, `_` for the systemd driver's slices, none for static
//! pods), then punctuation, then zero or more `word<punct>` segments (`docker-`,
//! `cri-containerd:`, `crio-`) and a container ID running to the end. Examples:
//! `/kubepods/burstable/pod2c48913c-b29f-11e7-9350-020968147796/9bca8d63…` and
//! `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod72f7f152_440c_66ac_9084_e0fc1d8a910c.slice/cri-containerd-b2a1….scope`.
//! cri-o paths without a pod UID (KubeEdge) cannot name a pod and are ignored.

/// A pod UID reduced to its 32 lowercase hex digits: the form both spellings share.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct UidKey(String);

/// What one cgroup file says about its process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CgroupPod {
    /// No line names a pod container.
    None,
    /// Every naming line names this pod (and one container).
    Pod(UidKey),
    /// Lines name different pods or containers: the process is skipped (spec §3.6).
    Conflict,
    /// A line is not `id:controllers:path`.
    Malformed,
}

// === impl UidKey ===

impl UidKey {
    /// The key of a UID as the API spells it; `None` unless it has exactly 32 hex digits, each
    /// group separated by at most one punctuation character.
    pub(super) fn of_uid(uid: &str) -> Option<UidKey> {
        let (key, len) = parse_uid(uid.as_bytes())?;
        (len == uid.len()).then_some(key)
    }
}

/// Reads a cgroup file's text.
pub(super) fn pod_of(cgroup_file: &str) -> CgroupPod {
    let mut found: Option<(UidKey, &str)> = None;
    for line in cgroup_file.lines().filter(|l| !l.is_empty()) {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(_), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            return CgroupPod::Malformed;
        };
        let Some((uid, container)) = pod_container_of_path(path) else {
            continue;
        };
        match &found {
            None => found = Some((uid, container)),
            Some((u, c)) if *u == uid && *c == container => {}
            Some(_) => return CgroupPod::Conflict,
        }
    }
    match found {
        Some((uid, _)) => CgroupPod::Pod(uid),
        None => CgroupPod::None,
    }
}

/// The pod UID and container ID a cgroup path names (leftmost match).
fn pod_container_of_path(path: &str) -> Option<(UidKey, &str)> {
    let path = path.strip_suffix(".scope").unwrap_or(path);
    let b = path.as_bytes();
    (0..b.len()).find_map(|i| {
        if !is_punct(b[i]) || !b[i + 1..].starts_with(b"pod") {
            return None;
        }
        let start = i + 4;
        let (uid, len) = parse_uid(&b[start..])?;
        let after = start + len;
        if !b.get(after).copied().is_some_and(is_punct) {
            return None;
        }
        container_tail(&path[after + 1..]).map(|c| (uid, c))
    })
}

/// `(?:[^punct]+[punct])*([^punct]+)$`: the container ID, the last word.
fn container_tail(tail: &str) -> Option<&str> {
    let b = tail.as_bytes();
    let starts_ok = b.first().is_some_and(|c| !is_punct(*c));
    let ends_ok = b.last().is_some_and(|c| !is_punct(*c));
    let no_double = !b.windows(2).any(|w| is_punct(w[0]) && is_punct(w[1]));
    if !(starts_ok && ends_ok && no_double) {
        return None;
    }
    let last = b.iter().rposition(|c| is_punct(*c)).map_or(0, |p| p + 1);
    Some(&tail[last..])
}

/// Parses `8[p]4[p]4[p]4[p]12` hex digits at the start of `b`; returns the key and bytes used.
fn parse_uid(b: &[u8]) -> Option<(UidKey, usize)> {
    let mut key = String::with_capacity(32);
    let mut pos = 0;
    for (n, group) in [8usize, 4, 4, 4, 12].into_iter().enumerate() {
        if n > 0 && b.get(pos).copied().is_some_and(is_punct) {
            pos += 1;
        }
        let digits = b.get(pos..pos + group)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        key.extend(digits.iter().map(|d| char::from(d.to_ascii_lowercase())));
        pos += group;
    }
    Some((UidKey(key), pos))
}

/// POSIX `[[:punct:]]` (ASCII punctuation), as Go's regexp class.
fn is_punct(c: u8) -> bool {
    c.is_ascii_punctuation()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "2c48913c-b29f-11e7-9350-020968147796";

    fn key(uid: &str) -> UidKey {
        UidKey::of_uid(uid).expect("valid uid")
    }

    #[test]
    fn uid_keys_join_both_spellings() {
        let k = key(UID);
        assert_eq!(k, key("2c48913c_b29f_11e7_9350_020968147796"));
        assert_eq!(k, key("2C48913CB29F11E79350020968147796"));
        assert_eq!(k.0, "2c48913cb29f11e79350020968147796");
        for bad in [
            "",
            "2c48913c-b29f-11e7-9350-02096814779",
            "2c48913c-b29f-11e7-9350-0209681477966",
        ] {
            assert_eq!(UidKey::of_uid(bad), None, "{bad:?}");
        }
        assert_eq!(
            UidKey::of_uid("2c48913c--b29f-11e7-9350-020968147796"),
            None
        );
        assert_eq!(UidKey::of_uid("2c48913g-b29f-11e7-9350-020968147796"), None);
    }

    #[test]
    fn cgroup_files_name_pods() {
        let want = CgroupPod::Pod(key(UID));
        let cases: Vec<(&str, String, CgroupPod)> = vec![
            ("empty", String::new(), CgroupPod::None),
            ("host process", "0::/init.scope\n".into(), CgroupPod::None),
            (
                "v1 cgroupfs",
                format!(
                    "12:memory:/kubepods/burstable/pod{UID}/9bca8d63d5fa\n\
                     11:cpu,cpuacct:/kubepods/burstable/pod{UID}/9bca8d63d5fa\n1:name=systemd:/\n"
                ),
                want.clone(),
            ),
            (
                "v2 systemd with underscores",
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2c48913c_b29f_11e7_9350_020968147796.slice/cri-containerd-b2a102854b49.scope\n".into(),
                want.clone(),
            ),
            (
                "colon separated containerd",
                "0::/kubepods-besteffort-pod2c48913c_b29f_11e7_9350_020968147796.slice:cri-containerd:b2a102854b49\n".into(),
                want.clone(),
            ),
            (
                "docker inside docker",
                format!("0::/docker/8d461fa57657/kubepods/besteffort/pod{UID}/aff34703e5e1\n"),
                want.clone(),
            ),
            (
                "cri-o",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod2c48913c_b29f_11e7_9350_020968147796.slice/crio-45490e76e087.scope\n".into(),
                want.clone(),
            ),
            ("cgroup namespace relative", format!("0::/../../pod{UID}/9bca8d63d5fa\n"), want.clone()),
            ("static pod uid", "0::/kubepods/pod2c48913cb29f11e79350020968147796/abc\n".into(), want.clone()),
            ("pod slice without container", format!("0::/kubepods/burstable/pod{UID}\n"), CgroupPod::None),
            ("pod dir, container id missing", format!("0::/kubepods/burstable/pod{UID}/\n"), CgroupPod::None),
            ("double punctuation before id", format!("0::/kubepods/pod{UID}/docker--abc\n"), CgroupPod::None),
            ("no punctuation before pod", format!("0::kubepod{UID}/abc\n"), CgroupPod::None),
            ("crio without pod uid", "0::/../crio-45490e76e0878aaa.scope\n".into(), CgroupPod::None),
            (
                "two containers",
                format!("2:cpu:/kubepods/pod{UID}/aaa\n1:memory:/kubepods/pod{UID}/bbb\n"),
                CgroupPod::Conflict,
            ),
            (
                "two pods",
                format!("2:cpu:/kubepods/pod{UID}/aaa\n1:memory:/kubepods/pod0e4b9a5c-3a55-4a4e-9a0d-5f2e8c1b7d21/aaa\n"),
                CgroupPod::Conflict,
            ),
            (
                "two containers, both scopes",
                format!("2:cpu:/kubepods/pod{UID}/docker-aaa.scope\n1:memory:/kubepods/pod{UID}/docker-bbb.scope\n"),
                CgroupPod::Conflict,
            ),
            ("not a cgroup line", "garbage\n".into(), CgroupPod::Malformed),
        ];
        for (name, text, want) in cases {
            assert_eq!(pod_of(&text), want, "{name}");
        }
    }
}
