//! Bearer tokens mapped to tenants. With no tokens configured every caller
//! may act for every tenant (the loopback default); with tokens, a call
//! must carry `authorization: Bearer <token>`, and a tenant's token acts
//! only for that tenant.

use kvtier_core::{TenantId, wire};
use tonic::Status;
use tonic::codegen::http::HeaderMap;

use crate::status::denied;

/// What one token may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// Every call, for this tenant only.
    Tenant(TenantId),
    /// Every call for every tenant, and server-wide statistics.
    Admin,
}

/// One bearer token and what it grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    /// The token a caller presents (`authorization: Bearer <secret>`, or in a shared-memory
    /// registration); compared in constant time.
    pub secret: String,
    /// What a caller presenting it may do.
    pub grant: Grant,
}

/// The server's bearer tokens. With none (the default), no token is checked and every caller
/// may act for every tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Auth {
    tokens: Vec<Token>,
}

/// Who is calling, as far as the server knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The server checks no tokens.
    Anyone,
    Tenant(TenantId),
    Admin,
}

impl Auth {
    /// Checks calls against `tokens`; an empty list checks nothing. Should two tokens share a
    /// secret, the later one's grant applies.
    pub fn new(tokens: Vec<Token>) -> Self {
        Self { tokens }
    }

    /// True when tokens are configured, so every call must present one.
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    pub(crate) fn caller(&self, headers: &HeaderMap) -> Result<Caller, Status> {
        if !self.enabled() {
            return Ok(Caller::Anyone);
        }
        let header = headers
            .get("authorization")
            .ok_or_else(|| Status::unauthenticated("this server needs `authorization: Bearer <token>`"))?;
        // The scheme is case-insensitive (RFC 9110).
        let presented = header
            .to_str()
            .ok()
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| Status::unauthenticated("the authorization header is not `Bearer <token>`"))?;
        self.holder(presented)
    }

    /// The caller presenting `token` where no header carries it (the
    /// shared-memory socket); an empty token is none.
    pub(crate) fn caller_with_token(&self, token: &str) -> Result<Caller, Status> {
        match (self.enabled(), token.is_empty()) {
            (false, _) => Ok(Caller::Anyone),
            (true, true) => Err(Status::unauthenticated("this server needs a token")),
            (true, false) => self.holder(token),
        }
    }

    fn holder(&self, presented: &str) -> Result<Caller, Status> {
        // Every token is compared, each in time independent of where it
        // differs, so that timing tells nothing about any of them.
        let mut found = None;
        for token in &self.tokens {
            if same_secret(token.secret.as_bytes(), presented.as_bytes()) {
                found = Some(&token.grant);
            }
        }
        match found {
            Some(Grant::Tenant(t)) => Ok(Caller::Tenant(t.clone())),
            Some(Grant::Admin) => Ok(Caller::Admin),
            None => Err(Status::unauthenticated("the token is not valid on this server")),
        }
    }
}

impl Caller {
    /// Refuses a call for a tenant the caller may not act for.
    pub(crate) fn check_tenant(&self, tenant: &TenantId) -> Result<(), Status> {
        match self {
            Caller::Anyone | Caller::Admin => Ok(()),
            Caller::Tenant(mine) if mine == tenant => Ok(()),
            Caller::Tenant(mine) => Err(denied(
                wire::TENANT.path,
                format!(
                    "is {:?}, but the token is for tenant {:?}",
                    tenant.as_str(),
                    mine.as_str()
                ),
            )),
        }
    }

    /// Refuses a server-wide call (`method`) to a tenant's token.
    pub(crate) fn check_admin(&self, method: &str) -> Result<(), Status> {
        match self {
            Caller::Anyone | Caller::Admin => Ok(()),
            Caller::Tenant(t) => Err(denied(
                "authorization",
                format!("{method} is server-wide; the token is for tenant {:?} only", t.as_str()),
            )),
        }
    }

    /// The tenant whose statistics a `GetStats` without a tenant shows:
    /// none (the whole server) unless the caller is one tenant.
    pub(crate) fn own_tenant(&self) -> Option<&TenantId> {
        match self {
            Caller::Tenant(t) => Some(t),
            Caller::Anyone | Caller::Admin => None,
        }
    }
}

fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}
