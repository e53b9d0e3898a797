use std::path::{Path, PathBuf};

use kvtier_core::FieldError;
use kvtier_tiers::{LockError, TierError};

use crate::accounts::OverLimit;

/// Everything a store operation can refuse. Each variant has exactly one
/// status code in the API; the server maps them in one exhaustive `match`.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request is malformed on its own (wrong length, out of range, bad
    /// name). Nothing changed.
    #[error("{0}")]
    InvalidArgument(FieldError),
    /// The named object (a sequence) does not exist. Nothing changed.
    #[error("{what} does not exist")]
    NotFound {
        /// What was asked for, e.g. `sequence` and its key.
        what: String,
    },
    /// The object to create exists already (a sequence of the same key).
    /// Nothing changed.
    #[error("{what} already exists")]
    AlreadyExists {
        /// What was to be created, e.g. `sequence` and its key.
        what: String,
    },
    /// Well-formed, but the current state forbids it (an illegal transition,
    /// a write that does not start at the end). Nothing changed.
    #[error("{0}")]
    FailedPrecondition(FieldError),
    /// No tier has room and nothing may be dropped to make it. Nothing changed.
    #[error("{0}")]
    ResourceExhausted(TierError),
    /// A request would pass the metadata budget or its tenant's quota.
    /// Nothing changed.
    #[error("{0}")]
    OverLimit(#[from] OverLimit),
    /// A tier's device failed the operation (EIO and the like). Nothing
    /// changed; a retry may succeed.
    #[error("{0}")]
    Unavailable(TierError),
    /// The manifest could not be read, written or locked.
    #[error("{0}")]
    Manifest(ManifestError),
    /// A broken invariant inside the store; a bug, reported rather than
    /// served.
    #[error("internal error: {0}")]
    Internal(String),
}

impl StoreError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidArgument(FieldError::new(field, message))
    }

    pub(crate) fn precondition(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::FailedPrecondition(FieldError::new(field, message))
    }
}

impl From<FieldError> for StoreError {
    fn from(e: FieldError) -> Self {
        Self::InvalidArgument(e)
    }
}

impl From<TierError> for StoreError {
    fn from(e: TierError) -> Self {
        match e {
            TierError::Full { .. } => Self::ResourceExhausted(e),
            TierError::Io { .. } if e.is_no_space() => Self::ResourceExhausted(e),
            TierError::Io { .. } | TierError::Reserve { .. } => Self::Unavailable(e),
            TierError::ZeroLength
            | TierError::ForeignSlot
            | TierError::OutOfBounds { .. }
            | TierError::InUse { .. } => Self::Internal(e.to_string()),
        }
    }
}

/// What every store operation returns.
pub type StoreResult<T> = Result<T, StoreError>;

/// The manifest's failures, kept apart from the tiers' I/O errors.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Reading, writing or opening the manifest file failed.
    #[error("manifest {op} failed on {path}: {source}")]
    Io {
        /// What was being done: `open`, `read`, `write`, `checkpoint`.
        op: &'static str,
        /// The manifest file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The manifest was read but is not in a format this kvtier reads (no
    /// header, or another format version).
    #[error("manifest {path} cannot be read: {why}")]
    Format {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it, and what to do about it.
        why: String,
    },
    /// The data directory's lock could not be taken: another process holds
    /// it, or locking itself failed.
    #[error("the data directory is in use: {0}")]
    InUse(LockError),
}

impl ManifestError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }
}
