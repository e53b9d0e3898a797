//! Response messages within the message limit, protobuf framing included:
//! a stock gRPC client refuses a message over its receive limit (4 MiB by
//! default), and tonic refuses to send one over the server's.

use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use prost::Message;
use prost::encoding::encoded_len_varint;
use tonic::Status;

use crate::status::invalid;

/// Default and maximum encoded bytes per response message.
const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
const MAX_CHUNK_BYTES: usize = 32 << 20;

/// The largest response message for a request's `max_chunk_bytes`, capped
/// at the server's own limit.
pub(crate) fn limit(max_chunk_bytes: u32, server_limit: usize) -> Result<usize, Status> {
    let asked = match max_chunk_bytes as usize {
        0 => DEFAULT_CHUNK_BYTES,
        n if n > MAX_CHUNK_BYTES => {
            return Err(invalid(
                wire::MAX_CHUNK_BYTES,
                format!("is {n}, at most {MAX_CHUNK_BYTES} allowed"),
            ));
        }
        n => n,
    };
    Ok(asked.min(server_limit))
}

/// Refuses a limit that one page of `page_bytes` cannot fit in (with room
/// to spare for its message's other fields), before anything is read.
pub(crate) fn check_page_fits(page_bytes: usize, limit: usize) -> Result<(), Status> {
    const FIELDS: usize = 64;
    if page_bytes + FIELDS > limit {
        return Err(invalid(
            wire::MAX_CHUNK_BYTES,
            format!(
                "allows messages of {limit} bytes (the smaller of it and the server's max_message_bytes), \
                 but one page of this layout takes {page_bytes} bytes and its fields"
            ),
        ));
    }
    Ok(())
}

/// Refuses a limit that an attending selection's answer cannot fit in,
/// before anything is selected: its first message holds every query
/// head's row (`query_heads` of `head_dim` floats), its first head's
/// selection (at most `pages_per_head` pages) and its other fields, which
/// [`ATTENTION_FIELDS`] leaves room for.
pub(crate) fn check_attention_fits(
    query_heads: usize,
    head_dim: usize,
    pages_per_head: usize,
    limit: usize,
) -> Result<(), Status> {
    let row = field_len(&pb::QueryAttention {
        query_head: u32::MAX,
        out: vec![0; head_dim * 4].into(),
        lse: f32::MAX,
        tokens: u64::MAX,
    });
    let page = field_len(&pb::SelectedPage {
        page: u32::MAX,
        bound: f32::MAX,
        state: pb::PageState::Summary as i32,
        cold_tier: pb::Tier::Nvme as i32,
        miss: pb::Miss::NoRoom as i32,
    });
    let head = pb::HeadSelection {
        kv_head: u32::MAX,
        query_head: Some(u32::MAX),
        pages: Vec::new(),
        selected_but_gone: u32::MAX,
    };
    // Its pages, and the longer length prefix they may need.
    let first_head = field_len(&head) + pages_per_head.saturating_mul(page) + 4;
    let rows = query_heads.saturating_mul(row);
    if rows.saturating_add(first_head).saturating_add(ATTENTION_FIELDS) > limit {
        return Err(invalid(
            wire::MAX_CHUNK_BYTES,
            format!(
                "allows messages of {limit} bytes (the smaller of it and the server's max_message_bytes), \
                 but an attending selection's first message holds {query_heads} query heads' rows of \
                 {head_dim} floats ({rows} bytes), a head's selection of up to {pages_per_head} pages \
                 ({first_head} bytes) and its other fields"
            ),
        ));
    }
    Ok(())
}

/// Room in an attending selection's first message for its totals, timing
/// and the append's answer (about 300 bytes at their widest).
const ATTENTION_FIELDS: usize = 1 << 10;

/// What one item of a repeated message field (field number below 16) adds
/// to its message.
fn field_len<T: Message>(item: &T) -> usize {
    let len = item.encoded_len();
    1 + encoded_len_varint(len as u64) + len
}

/// Splits `items` into runs, in order, such that a message of `base` bytes
/// plus one run encodes to at most `limit` bytes. `what` names an item for
/// the error when one alone does not fit.
pub(crate) fn fit<T: Message>(items: Vec<T>, base: usize, limit: usize, what: &str) -> Result<Vec<Vec<T>>, Status> {
    fit_within(items, base, limit, limit, what)
}

/// [`fit`], with runs cut at `target` bytes (at most `limit`) where they
/// can be: an item larger than `target` that fits `limit` is a run alone.
pub(crate) fn fit_within<T: Message>(
    items: Vec<T>,
    base: usize,
    target: usize,
    limit: usize,
    what: &str,
) -> Result<Vec<Vec<T>>, Status> {
    let target = target.min(limit);
    let mut runs: Vec<Vec<T>> = Vec::new();
    let mut used = 0;
    for item in items {
        let len = field_len(&item);
        if base + len > limit {
            return Err(invalid(
                wire::MAX_CHUNK_BYTES,
                format!(
                    "allows messages of {limit} bytes (the smaller of it and the server's max_message_bytes), \
                     but one {what} alone takes {} bytes",
                    base + len
                ),
            ));
        }
        match runs.last_mut() {
            Some(run) if used + len <= target => {
                used += len;
                run.push(item);
            }
            _ => {
                used = base + len;
                runs.push(vec![item]);
            }
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use kvtier_proto::v1 as pb;

    use super::*;

    fn page(bytes: usize) -> pb::Page {
        pb::Page {
            kv_head: 3,
            page: 70_000,
            kv: vec![7u8; bytes].into(),
            tokens: 16,
            ..Default::default()
        }
    }

    /// Every run's message encodes within the limit, and within the target
    /// unless it is one page, for page sizes around the points where the
    /// length prefixes grow, and nothing is lost.
    #[test]
    fn every_message_fits_and_every_page_is_kept() {
        let limits = [300, 4096, 65_536, 1 << 20];
        let targets = limits.iter().flat_map(|&l| [(l, l), (l / 3, l)]);
        for (target, limit) in targets {
            for size in [0, 1, 100, 127, 128, 250, 4000, 16_383, 16_384, 60_000] {
                let pages: Vec<pb::Page> = (0..40).map(|_| page(size)).collect();
                let Ok(runs) = fit_within(pages, 0, target, limit, "page") else {
                    assert!(
                        field_len(&page(size)) > limit,
                        "refused a page that fits: {size} in {limit}"
                    );
                    continue;
                };
                assert_eq!(runs.iter().map(Vec::len).sum::<usize>(), 40);
                let last = runs.len() - 1;
                for (i, run) in runs.into_iter().enumerate() {
                    let n = run.len();
                    let msg = pb::FetchPagesResponse { pages: run };
                    assert!(
                        msg.encoded_len() <= limit && (n == 1 || msg.encoded_len() <= target),
                        "{} > {target} of {limit} ({n} pages of {size})",
                        msg.encoded_len()
                    );
                    // Runs before the last are full: one more page would
                    // not have fit the target.
                    let mut bigger = msg.clone();
                    bigger.pages.push(page(size));
                    assert!(
                        i == last || bigger.encoded_len() > target,
                        "run {i} of {n} pages could take another"
                    );
                }
            }
        }
    }
}
