//! Names of tenants and sequences, validated as they arrive in requests.

use crate::wire;
use std::fmt;
use std::sync::Arc;

use crate::FieldError;

/// An isolation domain. Sequences, prefix sharing and (later) quotas never
/// cross tenants.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(Arc<str>);

/// A sequence's name within its tenant, chosen by the client (an inference
/// engine's request id, typically).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId(Arc<str>);

/// The full name of a sequence.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceKey {
    /// The tenant the sequence belongs to.
    pub tenant: TenantId,
    /// The sequence's name within `tenant`.
    pub sequence: SequenceId,
}

impl TenantId {
    /// Name of the tenant that an empty tenant name stands for.
    pub const DEFAULT: &'static str = "default";
    const MAX_LEN: usize = 64;

    /// An empty name means the default tenant, so single-tenant users never
    /// have to think about tenants.
    pub fn parse(field: &str, name: &str) -> Result<Self, FieldError> {
        if name.is_empty() {
            return Ok(Self(Self::DEFAULT.into()));
        }
        if name.len() > Self::MAX_LEN {
            return Err(FieldError::new(
                field,
                format!("is {} bytes long, at most {} allowed", name.len(), Self::MAX_LEN),
            ));
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(FieldError::new(
                field,
                format!("contains {c:?}; only ASCII letters, digits, '-', '_' and '.' are allowed"),
            ));
        }
        Ok(Self(name.into()))
    }

    /// The tenant's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl SequenceId {
    const MAX_LEN: usize = 256;

    /// Validates a sequence name: required, at most 256 bytes, no control
    /// characters. Errors name `field`.
    pub fn parse(field: &str, name: &str) -> Result<Self, FieldError> {
        if name.is_empty() {
            return Err(FieldError::new(field, "is required"));
        }
        if name.len() > Self::MAX_LEN {
            return Err(FieldError::new(
                field,
                format!("is {} bytes long, at most {} allowed", name.len(), Self::MAX_LEN),
            ));
        }
        if name.chars().any(char::is_control) {
            return Err(FieldError::new(field, "contains a control character"));
        }
        Ok(Self(name.into()))
    }

    /// The sequence's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl SequenceKey {
    /// Validates both names, reporting errors against the `tenant` and
    /// `sequence_id` request fields.
    pub fn parse(tenant: &str, sequence: &str) -> Result<Self, FieldError> {
        Ok(Self {
            tenant: TenantId::parse(wire::TENANT.path, tenant)?,
            sequence: SequenceId::parse(wire::SEQUENCE_ID.path, sequence)?,
        })
    }
}

impl fmt::Display for SequenceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant.0, self.sequence.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_tenant_is_the_default_tenant() {
        assert_eq!(TenantId::parse("tenant", "").unwrap().as_str(), "default");
    }

    #[test]
    fn bad_names_name_their_field() {
        assert_eq!(TenantId::parse("tenant", "a b").unwrap_err().field, "tenant");
        assert_eq!(SequenceKey::parse("t", "").unwrap_err().field, "sequence_id");
        assert_eq!(SequenceKey::parse("t", "a\nb").unwrap_err().field, "sequence_id");
        assert!(SequenceKey::parse("t", &"x".repeat(257)).is_err());
        assert!(SequenceKey::parse("t", "req-42/π").is_ok());
    }
}
