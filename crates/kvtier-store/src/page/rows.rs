//! A page's rows in a slot: K rows `[page_size][head_dim]` at offset 0,
//! V rows at `page_size · row_bytes`.

use std::mem::MaybeUninit;

use kvtier_core::Layout;
use kvtier_tiers::{Slot, Tier, TierError};

/// Writes K and V rows (`[n][head_dim]` each) starting at row `first_row`.
pub(crate) fn write_rows(
    tier: &dyn Tier,
    slot: &mut Slot,
    layout: &Layout,
    first_row: u32,
    keys: &[u8],
    values: &[u8],
) -> Result<(), TierError> {
    let row = layout.row_bytes() as u64;
    let v_base = u64::from(layout.page_size()) * row;
    tier.write(slot, u64::from(first_row) * row, keys)?;
    tier.write(slot, v_base + u64::from(first_row) * row, values)
}

/// The first `rows` K rows then V rows of a whole page's bytes.
pub(crate) fn rows_of(page: &[u8], layout: &Layout, rows: u32) -> Vec<u8> {
    let n = rows as usize * layout.row_bytes();
    let v = layout.page_size() as usize * layout.row_bytes();
    [&page[..n], &page[v..v + n]].concat()
}

/// Reads a page's first K rows into `dst.0` and as many V rows into
/// `dst.1`: as many rows as each is long.
pub(crate) fn read_rows_into(
    tier: &dyn Tier,
    slot: &Slot,
    layout: &Layout,
    (k, v): (&mut [MaybeUninit<u8>], &mut [MaybeUninit<u8>]),
) -> Result<(), TierError> {
    tier.read_uninit(slot, 0, k)?;
    tier.read_uninit(slot, u64::from(layout.page_size()) * layout.row_bytes() as u64, v)
}
