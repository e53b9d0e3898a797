//! Pins: holders that need pages to stay where they are.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::PhysPage;

/// Pins pages for as long as it lives.
#[derive(Debug)]
pub(crate) struct Pins(Vec<Arc<PhysPage>>);

impl Pins {
    pub(crate) fn new(pages: Vec<Arc<PhysPage>>) -> Self {
        for p in &pages {
            p.pins.fetch_add(1, Ordering::AcqRel);
        }
        Self(pages)
    }

    pub(crate) fn pages(&self) -> &[Arc<PhysPage>] {
        &self.0
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for p in &self.0 {
            p.pins.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
