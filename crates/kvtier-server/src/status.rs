//! The one mapping from store errors to gRPC status codes.

use kvtier_cluster::{OWNER_ADDR, OWNER_NODE, Refusal};
use kvtier_core::FieldError;
use kvtier_store::StoreError;
use tonic::{Code, Status};

pub(crate) fn to_status(e: StoreError) -> Status {
    let code = match &e {
        StoreError::InvalidArgument(_) => Code::InvalidArgument,
        StoreError::NotFound { .. } => Code::NotFound,
        StoreError::AlreadyExists { .. } => Code::AlreadyExists,
        StoreError::FailedPrecondition(_) => Code::FailedPrecondition,
        StoreError::ResourceExhausted(_) | StoreError::OverLimit(_) => Code::ResourceExhausted,
        StoreError::Unavailable(_) | StoreError::Manifest(_) => Code::Unavailable,
        StoreError::Internal(_) => Code::Internal,
    };
    if code == Code::Internal {
        tracing::error!(error = %e, "internal error");
    }
    Status::new(code, e.to_string())
}

/// A malformed request field, found while converting from protobuf.
pub(crate) fn field_status(e: FieldError) -> Status {
    to_status(StoreError::InvalidArgument(e))
}

pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Status {
    field_status(FieldError::new(field, message))
}

/// A request for something the caller's token does not cover.
pub(crate) fn denied(field: &str, message: impl std::fmt::Display) -> Status {
    Status::permission_denied(format!("{field}: {message}"))
}

/// A cluster's refusal of a call for a sequence.
pub(crate) fn refused(r: Refusal) -> Status {
    let code = match &r {
        Refusal::Elsewhere { .. } | Refusal::NotHandedOver { .. } => Code::FailedPrecondition,
        Refusal::ExistsElsewhere { .. } => Code::AlreadyExists,
        Refusal::OwnerOut { .. } | Refusal::Unavailable { .. } | Refusal::Fenced { .. } => Code::Unavailable,
        Refusal::Lost { .. } => Code::DataLoss,
        Refusal::Recreated { .. } => Code::NotFound,
    };
    let mut status = Status::new(code, r.to_string());
    if let Some((node, addr)) = r.redirect() {
        let metadata = status.metadata_mut();
        for (key, value) in [(OWNER_NODE, node), (OWNER_ADDR, addr)] {
            if let Ok(value) = value.parse() {
                metadata.insert(key, value);
            }
        }
    }
    status
}
