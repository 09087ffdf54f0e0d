//! The conformance suite against the fs tier: plain, with checksums, bounded (GC on), and
//! published by a rename. Each fixture reopens on its root, builds from a config JSON by type
//! name, and (with checksums) damages blocks on disk.

use kv_tier_fs::Checksum;
use kv_tier_testkit::temp_root;

use crate::support::*;

kv_tier_testkit::conformance_tests!(|| async {
    let root = temp_root();
    fs_fixture(root.path().to_path_buf(), cfg(root.path())).keep(root)
});

mod checksummed {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.checksum = Checksum::Crc32c;
        fs_fixture(root.path().to_path_buf(), c).keep(root)
    });
}

mod bounded {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        fs_fixture(
            root.path().to_path_buf(),
            conformance_bounded_cfg(root.path()),
        )
        .keep(root)
    });
}

/// Checksums on, published through a named temp file and a rename (the fallback where
/// `O_TMPFILE` is missing).
mod renamed {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.checksum = Checksum::Crc32c;
        c.tmpfile_publish = false;
        fs_fixture(root.path().to_path_buf(), c).keep(root)
    });
}
