//! The error for a request value that is malformed on its own.

use std::fmt;

/// A request value that is malformed on its own, named by its field path in
/// the API (`layout.head_dim`, `kv`, `pages[3]`), so a client can see exactly
/// what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path of the offending value, e.g. `layout.head_dim` or `pages[3]`.
    pub field: String,
    /// What is wrong with it, phrased to follow the field name ("is required").
    pub message: String,
}

impl FieldError {
    /// An error for `field` (a path or a [`crate::wire::Field`]) saying `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for FieldError {}
