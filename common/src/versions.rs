//! The Kubernetes versions the suite supports, and what it says of a cluster outside them.
//!
//! The range is five minors ending at the newest release, as upstream and the managed
//! offerings support them; docs/testbed.md has the support matrix and the policy for moving it.
//! A cluster outside the range is served all the same (refusing it would stop a fleet the day a
//! new minor is released), with a warning that names the version and the range.

/// The oldest supported minor of Kubernetes 1.
pub const OLDEST_MINOR: u32 = 33;
/// The newest supported minor of Kubernetes 1.
pub const NEWEST_MINOR: u32 = 37;

/// Where a cluster's version stands against the supported range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    Supported,
    /// Older than [`OLDEST_MINOR`]: behaviour the suite relies on may be missing.
    TooOld(u32),
    /// Newer than [`NEWEST_MINOR`]: not yet tested.
    TooNew(u32),
    /// The version string does not read as `v1.MINOR…`.
    Unknown,
}

/// Reads a `gitVersion` (`v1.37.2`, `v1.33.13-eks-1234`) against the supported range.
pub fn support(git_version: &str) -> Support {
    let minor = git_version.trim().strip_prefix("v1.").and_then(|rest| {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    match minor {
        None => Support::Unknown,
        Some(m) if m < OLDEST_MINOR => Support::TooOld(m),
        Some(m) if m > NEWEST_MINOR => Support::TooNew(m),
        Some(_) => Support::Supported,
    }
}

/// The warning for `cluster` (say "the upper cluster") at `git_version`, or `None` when the
/// version is supported.
pub fn warning(cluster: &str, git_version: &str) -> Option<String> {
    let range = format!("1.{OLDEST_MINOR} to 1.{NEWEST_MINOR}");
    match support(git_version) {
        Support::Supported => None,
        Support::TooOld(_) => Some(format!(
            "{cluster} runs Kubernetes {git_version}, older than the supported {range}: \
             behaviour this release relies on may be missing there; upgrade the cluster"
        )),
        Support::TooNew(_) => Some(format!(
            "{cluster} runs Kubernetes {git_version}, newer than the supported {range}: \
             it is served, but this release was not tested against it"
        )),
        Support::Unknown => Some(format!(
            "{cluster} reports the version {git_version:?}, which does not read as v1.MINOR; \
             the supported range is {range}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_against_the_range() {
        assert_eq!(support("v1.37.2"), Support::Supported);
        assert_eq!(support("v1.33.13-eks-4a1b"), Support::Supported);
        assert_eq!(support("v1.20.2"), Support::TooOld(20));
        assert_eq!(support("v1.38.0-beta.0"), Support::TooNew(38));
        assert_eq!(support("v2.0.0"), Support::Unknown);
        assert_eq!(support(""), Support::Unknown);
        assert_eq!(warning("lower-a", "v1.35.4"), None);
        let old = warning("the lower cluster lower-b", "v1.32.9").unwrap();
        assert!(old.contains("v1.32.9") && old.contains("1.33 to 1.37"), "{old}");
        let new = warning("the upper cluster", "v1.38.0").unwrap();
        assert!(new.contains("not tested"), "{new}");
    }
}
