//! The error type shared by every kv-tier crate.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Result alias with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in kv-tier. Every message names the key, path, field or tier it is about.
///
/// The error is `Clone` (I/O sources are shared behind an `Arc`) so a job-level failure can be
/// reported against every key of the job.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid. `field` is a path such as `secondary_tiers[0].root_dir`
    /// (empty when the config as a whole is: not JSON, not an object).
    #[error("{}", config_message(.field, .reason))]
    InvalidConfig {
        /// The offending field, as a path into the config JSON.
        field: String,
        /// Why the value is refused.
        reason: String,
    },
    /// A block key could not be built.
    #[error("invalid block key: {reason}")]
    InvalidKey {
        /// Why the key is refused.
        reason: String,
    },
    /// The key is not present in the tier.
    #[error("block {key} not found in tier `{tier}`")]
    NotFound {
        /// The missing key.
        key: crate::BlockKey,
        /// The tier asked.
        tier: String,
    },
    /// The stored block is damaged (short, wrong size, checksum mismatch); it is never returned.
    #[error("block {key} in tier `{tier}` is corrupt: {reason}")]
    Corrupt {
        /// The damaged key.
        key: crate::BlockKey,
        /// The tier that held it.
        tier: String,
        /// What was wrong with it.
        reason: String,
    },
    /// A buffer handed to a job does not have the block size.
    #[error("block {key}: buffer is {got} bytes, the block size is {expected}")]
    WrongSize {
        /// The key whose buffer is wrong.
        key: crate::BlockKey,
        /// Buffer length given.
        got: usize,
        /// The configured block size.
        expected: usize,
    },
    /// The device or bucket is full.
    #[error("tier `{tier}` is out of space: {detail}")]
    NoSpace {
        /// The full tier.
        tier: String,
        /// What was being written.
        detail: String,
    },
    /// The DRAM pool cannot make room: every slot that would have to go is pinned.
    #[error("cannot make room for {needed} block(s): {evictable} evictable of {capacity} slots")]
    CapacityExhausted {
        /// Slots the call needed.
        needed: usize,
        /// Slots that could be freed or were free.
        evictable: usize,
        /// Total slots in the pool.
        capacity: usize,
    },
    /// An I/O call failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation (`open`, `pwrite`, `rename`, ...).
        op: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// The operating system's error.
        source: Arc<io::Error>,
    },
    /// A layout (namespace) on disk does not match the one configured.
    #[error("layout mismatch at {}: {reason}", path.display())]
    LayoutMismatch {
        /// The `config.json` (or other file) that disagrees.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A tier backend reported an error not covered above.
    #[error("tier `{tier}`: {message}")]
    Backend {
        /// The tier.
        tier: String,
        /// What the backend said.
        message: String,
        /// Whether retrying later may succeed.
        transient: bool,
    },
    /// An operation did not finish within its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// A tier's write-back is at its limit and its policy is `wait`: new blocks are refused
    /// until its store jobs catch up (or the DRAM pinned by write-back is at its limit).
    #[error(
        "write-back to tier `{tier}` is full ({queued_bytes} of {limit_bytes} bytes queued): try again after the next step"
    )]
    WriteBackFull {
        /// The tier (or the primary's name, [`crate::tier::PRIMARY_TIER_NAME`], for the
        /// pool-wide limit on DRAM pinned for write-back).
        tier: String,
        /// Bytes queued or in flight.
        queued_bytes: u64,
        /// The limit.
        limit_bytes: u64,
    },
    /// A tier panicked while running a job or probe; the manager caught it.
    #[error("tier `{tier}` panicked during {op}")]
    Panicked {
        /// The tier.
        tier: String,
        /// What it was doing (`store job`, `load job`, `probe`).
        op: String,
    },
    /// The tier or manager has been shut down.
    #[error("`{what}` has been shut down")]
    Shutdown {
        /// What was shut down.
        what: String,
    },
}

impl From<crate::key::InvalidKey> for Error {
    fn from(e: crate::key::InvalidKey) -> Self {
        Error::InvalidKey { reason: e.reason }
    }
}

impl Error {
    /// Builds an [`Error::InvalidConfig`].
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Builds an [`Error::Io`] from an operation, a path and an `io::Error`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source: Arc::new(source),
        }
    }

    /// Whether retrying the same operation later may succeed (the data is not known to be gone).
    ///
    /// Transient: timeouts, panics of a tier, a full DRAM pool, backend errors flagged transient, and I/O errors
    /// such as `EIO`, `EINTR`, `EAGAIN`, `EMFILE`, `ENFILE`, `EACCES`, `EPERM`, `ELOOP`,
    /// `ENOMEM`, `EBUSY` and `ETIMEDOUT`. Not transient: not-found, corrupt, wrong size, bad
    /// config, layout mismatch, shutdown.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Timeout { .. }
            | Error::Panicked { .. }
            | Error::WriteBackFull { .. }
            | Error::CapacityExhausted { .. }
            | Error::NoSpace { .. } => true,
            Error::Backend { transient, .. } => *transient,
            Error::Io { source, .. } => io_is_transient(source),
            _ => false,
        }
    }

    /// Shifts the field of an [`Error::InvalidConfig`] under `prefix` (`prefix.field`).
    pub fn within(self, prefix: &str) -> Self {
        match self {
            Error::InvalidConfig { field, reason } => Error::InvalidConfig {
                field: if field.is_empty() {
                    prefix.to_string()
                } else if field.starts_with('[') {
                    format!("{prefix}{field}")
                } else {
                    format!("{prefix}.{field}")
                },
                reason,
            },
            other => other,
        }
    }
}

fn io_is_transient(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    if let Some(code) = e.raw_os_error() {
        // Linux errno values (stable ABI).
        const EPERM: i32 = 1;
        const EINTR: i32 = 4;
        const EIO: i32 = 5;
        const EAGAIN: i32 = 11;
        const ENOMEM: i32 = 12;
        const EACCES: i32 = 13;
        const EBUSY: i32 = 16;
        const ENFILE: i32 = 23;
        const EMFILE: i32 = 24;
        const ELOOP: i32 = 40;
        const ETIMEDOUT: i32 = 110;
        return matches!(
            code,
            EPERM
                | EINTR
                | EIO
                | EAGAIN
                | ENOMEM
                | EACCES
                | EBUSY
                | ENFILE
                | EMFILE
                | ELOOP
                | ETIMEDOUT
        );
    }
    matches!(
        e.kind(),
        K::Interrupted
            | K::WouldBlock
            | K::TimedOut
            | K::PermissionDenied
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::BrokenPipe
            | K::OutOfMemory
    )
}

/// "invalid config field `FIELD`: REASON", or "invalid config: REASON" with no field.
fn config_message(field: &str, reason: &str) -> String {
    if field.is_empty() {
        format!("invalid config: {reason}")
    } else {
        format!("invalid config field `{field}`: {reason}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_classification() {
        let eio = Error::io("pread", "/x", io::Error::from_raw_os_error(5));
        assert!(eio.is_transient());
        let enoent = Error::io("open", "/x", io::Error::from_raw_os_error(2));
        assert!(!enoent.is_transient());
        assert!(!Error::config("a", "b").is_transient());
        assert!(
            Error::Timeout {
                op: "get".into(),
                after: Duration::from_secs(1)
            }
            .is_transient()
        );
    }

    #[test]
    fn messages_name_the_subject() {
        let e = Error::config("cpu_bytes_to_use", "must be positive").within("secondary_tiers[1]");
        assert_eq!(
            e.to_string(),
            "invalid config field `secondary_tiers[1].cpu_bytes_to_use`: must be positive"
        );
        let e = Error::config("", "not valid JSON: EOF");
        assert_eq!(e.to_string(), "invalid config: not valid JSON: EOF");
        let e = Error::io("open", "/tmp/a.bin", io::Error::from_raw_os_error(2));
        assert!(e.to_string().contains("/tmp/a.bin"), "{e}");
    }
}
