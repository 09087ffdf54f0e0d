//! The crate's errors mapped into core's: an I/O error becomes `NoSpace` when the disk or a
//! quota is full (a store can make room and retry), otherwise an `Io` error naming the
//! operation and the path; a failed load says whether it removed the damaged file.

use std::io;
use std::path::Path;

use kv_tier_core::Error;

/// Maps an I/O error of `op` on `path` in tier `tier` into core's error.
pub(crate) fn io_error(tier: &str, op: &'static str, path: &Path, e: io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::NoSpace {
            tier: tier.to_string(),
            detail: format!("{op} {}: {e}", path.display()),
        },
        _ => Error::io(op, path, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_or_quota_is_no_space_and_names_the_path() {
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = io_error(
                "fs",
                "write",
                Path::new("/c/x.bin"),
                io::Error::from_raw_os_error(errno),
            );
            match e {
                Error::NoSpace { tier, detail } => {
                    assert_eq!(tier, "fs");
                    assert!(detail.starts_with("write /c/x.bin: "), "{detail}");
                }
                e => panic!("{e:?}"),
            }
        }
        let e = io_error(
            "fs",
            "read",
            Path::new("/c/x.bin"),
            io::Error::from_raw_os_error(libc::EIO),
        );
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("/c/x.bin"), "{e}");
    }
}
