#![warn(missing_docs)]
//! The kvtier model, free of I/O: what a page is, which state it is in, what
//! its digest says, and which physical page backs it.
//!
//! Everything here is deterministic and synchronous so that it can be tested
//! exhaustively (property tests) and reused by every tier and by the server.

pub mod attend;
pub mod chunked;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod fast_exp;
pub mod hash;
pub mod ids;
pub mod index;
pub mod lane;
pub mod layout;
pub mod page_table;
pub mod parallel;
pub mod placement;
pub mod policy;
pub mod poll;
pub mod rank;
pub mod reuse;
pub mod score;
pub mod select;
pub mod sketch;
pub mod sketch_column;
pub mod sketch_score;
pub mod state;
pub mod summary;
pub mod wire;

pub use digest::{DIGEST_CHUNK_PAGES, DigestColumn};
pub use dtype::DType;
pub use error::FieldError;
pub use ids::{SequenceId, SequenceKey, TenantId};
pub use index::PageIndex;
pub use lane::{Lane, LogicalPage};
pub use layout::{LayerGroup, Layout, LayoutSpec};
pub use page_table::{PageTableError, PhysId, PhysicalPages};
pub use state::{Action, ColdTier, IllegalTransition, PageState, Reason};
pub use summary::Summary;
