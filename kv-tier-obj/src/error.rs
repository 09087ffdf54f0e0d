//! How `object_store` errors become kv-tier errors.

use kv_tier_core::{BlockKey, Error};

/// Converts an `object_store` error of `what` (`"PUT <path>"`, ...) on tier `tier` into the
/// core error, classified by its variant: not-found, permission and precondition errors are
/// not transient; everything else (5xx after retries, timeouts, connection errors) is.
pub(crate) fn classify(tier: &str, what: &str, e: &object_store::Error) -> Error {
    use object_store::Error as E;
    let transient = !matches!(
        e,
        E::NotFound { .. }
            | E::AlreadyExists { .. }
            | E::Precondition { .. }
            | E::NotImplemented { .. }
            | E::PermissionDenied { .. }
            | E::Unauthenticated { .. }
            | E::InvalidPath { .. }
            | E::NotSupported { .. }
            | E::UnknownConfigurationKey { .. }
    );
    Error::Backend {
        tier: tier.to_string(),
        message: format!("{what}: {e}"),
        transient,
    }
}

/// The error of a request that passed its deadline.
pub(crate) fn timed_out(tier: &str, what: &str, after: std::time::Duration) -> Error {
    Error::Timeout {
        op: format!("{what} on tier `{tier}`"),
        after,
    }
}

/// The error of a call after shutdown.
pub(crate) fn closed(tier: &str) -> Error {
    Error::Shutdown {
        what: format!("obj tier `{tier}`"),
    }
}

/// The error of a missing object.
pub(crate) fn not_found(tier: &str, key: BlockKey) -> Error {
    Error::NotFound {
        key,
        tier: tier.to_string(),
    }
}
