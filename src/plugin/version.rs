//! CNI spec versions the plugin speaks (`../shared/spec/cni.md` §0, §5).

use std::fmt;

/// One supported CNI spec version. Ordered oldest to newest.
///
/// 0.1.0 and 0.2.0 are deliberately absent: they have no `prevResult`, so no chaining.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    /// `0.3.0`
    V0_3_0,
    /// `0.3.1`
    V0_3_1,
    /// `0.4.0` (adds CHECK)
    V0_4_0,
    /// `1.0.0` (drops `ips[].version`)
    V1_0_0,
    /// `1.1.0` (adds GC, STATUS and interface/route extras)
    V1_1_0,
}

impl CniVersion {
    /// Every supported version, oldest first; this is what VERSION reports.
    pub const ALL: [CniVersion; 5] = [
        CniVersion::V0_3_0,
        CniVersion::V0_3_1,
        CniVersion::V0_4_0,
        CniVersion::V1_0_0,
        CniVersion::V1_1_0,
    ];

    /// The newest supported version, used when the config's version is unknown.
    pub const NEWEST: CniVersion = CniVersion::V1_1_0;

    /// Parses an exact version string (as skel does: no normalisation, `"1.0"` is not `"1.0.0"`).
    pub fn parse(s: &str) -> Option<CniVersion> {
        CniVersion::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// The version string as it appears in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            CniVersion::V0_3_0 => "0.3.0",
            CniVersion::V0_3_1 => "0.3.1",
            CniVersion::V0_4_0 => "0.4.0",
            CniVersion::V1_0_0 => "1.0.0",
            CniVersion::V1_1_0 => "1.1.0",
        }
    }

    /// True for the 0.x result family (0.3.0, 0.3.1, 0.4.0), whose `ips[]` carry `version`.
    pub fn is_legacy(self) -> bool {
        self < CniVersion::V1_0_0
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exact_strings_only() {
        for v in CniVersion::ALL {
            assert_eq!(CniVersion::parse(v.as_str()), Some(v));
        }
        for bad in ["", "0.1.0", "0.2.0", "1.0", "1.2.0", "1.0.1", " 1.0.0"] {
            assert_eq!(CniVersion::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ordering_and_family() {
        assert!(CniVersion::V0_3_1 < CniVersion::V0_4_0);
        assert!(CniVersion::V0_4_0.is_legacy());
        assert!(!CniVersion::V1_0_0.is_legacy());
        assert_eq!(CniVersion::NEWEST, CniVersion::V1_1_0);
    }
}
