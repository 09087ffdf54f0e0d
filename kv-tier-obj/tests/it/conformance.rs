//! The conformance suite against the obj tier: on object_store's InMemory (unbounded and
//! bounded) and on a real S3 server. Each fixture reopens on its store, builds from a config
//! JSON by type name, and damages objects behind the tier's back.

use std::sync::Arc;

use object_store::memory::InMemory;

use crate::support::*;

mod unbounded {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        on_memory(Arc::new(InMemory::new()), checked()).await
    });
}

mod bounded {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let mut c = checked();
        c.max_size_gb = Some((CAP_BLOCKS * BS) as f64 / (1u64 << 30) as f64);
        on_memory(Arc::new(InMemory::new()), c).await
    });
}

mod s3 {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let server = Arc::new(S3Server::start().await);
        on_server(server.clone()).await.keep(server)
    });
}
