//! Random operations on sequences, planned from the model: what to send,
//! what the server must answer, and what the model learns from the answer.
//! Shared by the model-based crash test and the kill -9 soak.

use std::ops::Range;

use kvtier_client::pb::apply_policy_request::Action as PolicyAction;
use kvtier_client::pb::policy::Scorer;
use kvtier_client::{Client, ClientError, actions, pb};
use proptest::prelude::*;
use tonic::Code;

use super::model::{Fate, HEADS, Model, PAGE, PREFIX_PAGES, SeqId, layout, prefix_hashes};

#[derive(Debug, Clone, Copy)]
pub enum Change {
    Evict,
    Summarize,
}

impl Change {
    pub fn fate(self, reason: pb::Reason) -> Fate {
        match self {
            Change::Evict => Fate::Gone(reason),
            Change::Summarize => Fate::Summary,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Move {
    OffloadHost,
    OffloadNvme,
    MigrateNvme,
}

/// Heads 0, 1, or both (2).
pub type Heads = u32;

fn heads(h: Heads) -> Range<u32> {
    if h < HEADS { h..h + 1 } else { 0..HEADS }
}

#[derive(Debug, Clone)]
pub enum Op {
    Create {
        seq: u8,
        prefix: Option<u8>,
    },
    Put {
        seq: u8,
        layer: u32,
        heads: Heads,
        tokens: u32,
        persist: bool,
    },
    Append {
        seq: u8,
        layer: u32,
        heads: Heads,
        tokens: u32,
        persist: bool,
    },
    Change {
        seq: u8,
        layer: u32,
        heads: Heads,
        page: u32,
        change: Change,
    },
    Move {
        seq: u8,
        layer: u32,
        page: u32,
        to: Move,
    },
    /// StreamingLLM over one layer down to `budget` tokens; `None`: offload.
    Policy {
        seq: u8,
        layer: u32,
        budget: u32,
        change: Option<Change>,
    },
    Drop {
        seq: u8,
    },
    /// Flips a byte of an NVMe block (among its first 64: page bytes).
    Corrupt {
        block: u8,
        offset: u8,
    },
    /// Reads everything back without a restart: must match exactly.
    Verify,
    Restart,
    /// kill -9 after `ms` of whatever the server does in the background.
    Kill {
        ms: u8,
    },
    /// kill -9 `us` into a write, transition or policy.
    KillDuring {
        op: Box<Op>,
        us: u16,
    },
}

/// Sequence `seq` of an operation (0..6: three names in each of two
/// tenants), numbered from name `base`.
fn id(seq: u8, base: u8) -> SeqId {
    SeqId {
        tenant: seq % 2,
        name: base + seq / 2,
    }
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![Just(Change::Evict), Just(Change::Summarize)]
}

/// Operations that a kill may cut off.
pub fn interruptible() -> impl Strategy<Value = Op> {
    let seq = 0u8..6;
    let heads = prop_oneof![1 => 0u32..2, 4 => Just(2u32)];
    prop_oneof![
        3 => (seq.clone(), 0u32..2, heads.clone(), 1u32..=12, any::<bool>())
            .prop_map(|(seq, layer, heads, tokens, persist)| Op::Put { seq, layer, heads, tokens, persist }),
        5 => (seq.clone(), 0u32..2, heads.clone(), 1u32..=6, any::<bool>())
            .prop_map(|(seq, layer, heads, tokens, persist)| Op::Append { seq, layer, heads, tokens, persist }),
        2 => (seq.clone(), 0u32..2, heads, 0u32..8, change())
            .prop_map(|(seq, layer, heads, page, change)| Op::Change { seq, layer, heads, page, change }),
        1 => (seq, 0u32..2, 4u32..=16, proptest::option::of(change()))
            .prop_map(|(seq, layer, budget, change)| Op::Policy { seq, layer, budget, change }),
    ]
}

pub fn op() -> impl Strategy<Value = Op> {
    let seq = 0u8..6;
    let to = prop_oneof![
        Just(Move::OffloadHost),
        Just(Move::OffloadNvme),
        Just(Move::MigrateNvme)
    ];
    prop_oneof![
        3 => (seq.clone(), proptest::option::of(0u8..2)).prop_map(|(seq, prefix)| Op::Create { seq, prefix }),
        11 => interruptible(),
        2 => (seq.clone(), 0u32..2, 0u32..8, to).prop_map(|(seq, layer, page, to)| Op::Move { seq, layer, page, to }),
        1 => seq.prop_map(|seq| Op::Drop { seq }),
        2 => (0u8..32, 0u8..64).prop_map(|(block, offset)| Op::Corrupt { block, offset }),
        1 => Just(Op::Verify),
        1 => Just(Op::Restart),
        1 => (0u8..40).prop_map(|ms| Op::Kill { ms }),
        2 => (interruptible(), 0u16..3000).prop_map(|(op, us)| Op::KillDuring { op: Box::new(op), us }),
    ]
}

/// A request, planned from the model, and what the model expects of it.
#[derive(Debug, Clone)]
pub enum Planned {
    Create {
        id: SeqId,
        prefix: Option<u8>,
        exists: bool,
    },
    Write {
        id: SeqId,
        layer: u32,
        heads: Range<u32>,
        at: u64,
        n: u64,
        persist: bool,
        put: bool,
        kv: bytes::Bytes,
        ok: bool,
    },
    Change {
        id: SeqId,
        layer: u32,
        heads: Range<u32>,
        page: u32,
        change: Change,
        ok: bool,
    },
    Move {
        id: SeqId,
        layer: u32,
        page: u32,
        to: Move,
    },
    Policy {
        id: SeqId,
        layer: u32,
        budget: u32,
        change: Option<Change>,
    },
    Drop {
        id: SeqId,
        exists: bool,
    },
}

/// What a request answered (attached pages for a create, durability for a
/// write).
pub type Answer = Result<(u64, pb::Durability), ClientError>;

fn code(answer: &Answer) -> Option<Code> {
    match answer {
        Ok(_) => None,
        Err(ClientError::Status(s)) => Some(s.code()),
        Err(_) => Some(Code::Unavailable),
    }
}

/// What to send for `op` (`None`: nothing applies now); its sequences are
/// named from `base` on.
pub fn plan(model: &Model, op: &Op, base: u8) -> Option<Planned> {
    let modelled = |seq: u8| model.seqs.get(&id(seq, base));
    Some(match op.clone() {
        Op::Create { seq, prefix } => Planned::Create {
            id: id(seq, base),
            prefix,
            exists: modelled(seq).is_some(),
        },
        Op::Put {
            seq,
            layer,
            heads: h,
            tokens,
            persist,
        }
        | Op::Append {
            seq,
            layer,
            heads: h,
            tokens,
            persist,
        } => {
            let put = matches!(op, Op::Put { .. });
            let rows = modelled(seq)?.rows(layer, heads(h));
            let at = rows[0];
            let same = rows.iter().all(|r| *r == at);
            let ok = same
                && if put {
                    at % PAGE == 0
                } else {
                    !model.append_refused(id(seq, base), layer, heads(h))
                };
            let n = u64::from(tokens);
            Planned::Write {
                id: id(seq, base),
                layer,
                heads: heads(h),
                at,
                n,
                persist,
                put,
                kv: model.kv(id(seq, base), layer, heads(h), at, at + n),
                ok,
            }
        }
        Op::Change {
            seq,
            layer,
            heads: h,
            page,
            change,
        } => {
            let full = modelled(seq)?.rows(layer, heads(h)).into_iter().min()? / PAGE;
            let page = page % u32::try_from(full).ok().filter(|f| *f > 0)?;
            let fate = change.fate(pb::Reason::Explicit);
            Planned::Change {
                id: id(seq, base),
                layer,
                heads: heads(h),
                page,
                change,
                ok: model.change_allowed(id(seq, base), layer, heads(h), u64::from(page), fate),
            }
        }
        Op::Move { seq, layer, page, to } => {
            let full = modelled(seq)?.rows(layer, 0..HEADS).into_iter().min()? / PAGE;
            let page = page % u32::try_from(full).ok().filter(|f| *f > 0)?;
            Planned::Move {
                id: id(seq, base),
                layer,
                page,
                to,
            }
        }
        Op::Policy {
            seq,
            layer,
            budget,
            change,
        } => {
            modelled(seq)?;
            Planned::Policy {
                id: id(seq, base),
                layer,
                budget,
                change,
            }
        }
        Op::Drop { seq } => Planned::Drop {
            id: id(seq, base),
            exists: modelled(seq).is_some(),
        },
        Op::Corrupt { .. } | Op::Verify | Op::Restart | Op::Kill { .. } | Op::KillDuring { .. } => return None,
    })
}

/// Sends a planned request.
pub async fn send(planned: Planned, client: Client) -> Answer {
    let done = (0, pb::Durability::Unspecified);
    match planned {
        Planned::Create { id, prefix, .. } => {
            let hashes = prefix.map(prefix_hashes).unwrap_or_default();
            let mut c = client.with_tenant(id.tenant());
            let r = c.create_sequence(&id.name(), layout(), hashes).await?;
            Ok((r.attached_pages, pb::Durability::Unspecified))
        }
        Planned::Write {
            id,
            layer,
            heads,
            at,
            n,
            persist,
            put,
            kv,
            ..
        } => {
            let mut c = client.with_tenant(id.tenant()).with_persist(persist);
            let durability = if put {
                let first_page = (at / PAGE) as u32;
                c.put_pages(&id.name(), layer, heads, first_page, n as u32, kv)
                    .await?
                    .durability()
            } else {
                c.append_tokens(&id.name(), layer, heads, n as u32, kv, Some(at))
                    .await?
                    .durability()
            };
            Ok((0, durability))
        }
        Planned::Change {
            id,
            layer,
            heads,
            page,
            change,
            ..
        } => {
            let action = match change {
                Change::Evict => actions::evict(),
                Change::Summarize => actions::summarize(1),
            };
            let mut c = client.with_tenant(id.tenant());
            c.set_page_state(&id.name(), layer..layer + 1, heads, page..page + 1, action)
                .await?;
            Ok(done)
        }
        Planned::Move { id, layer, page, to } => {
            let action = match to {
                Move::OffloadHost => actions::offload_to_host(),
                Move::OffloadNvme => actions::offload_to_nvme(),
                Move::MigrateNvme => actions::migrate_to_nvme(),
            };
            let mut c = client.with_tenant(id.tenant());
            c.set_page_state(&id.name(), layer..layer + 1, 0..HEADS, page..page + 1, action)
                .await?;
            Ok(done)
        }
        Planned::Policy {
            id,
            layer,
            budget,
            change,
        } => {
            let action = match change {
                Some(Change::Evict) => PolicyAction::Evict(pb::Evict {}),
                Some(Change::Summarize) => PolicyAction::Summarize(pb::Summarize { rows: 1 }),
                None => PolicyAction::Offload(pb::Offload {
                    tier: pb::Tier::Host as i32,
                }),
            };
            let req = pb::ApplyPolicyRequest {
                layer_start: layer,
                layer_count: 1,
                policy: Some(pb::Policy {
                    scorer: Some(Scorer::Streaming(pb::StreamingPolicy { sink_tokens: 4 })),
                    allocator: None,
                }),
                budget_tokens: budget,
                action: Some(action),
                ..Default::default()
            };
            client.with_tenant(id.tenant()).apply_policy(&id.name(), req).await?;
            Ok(done)
        }
        Planned::Drop { id, .. } => {
            client.with_tenant(id.tenant()).drop_sequence(&id.name()).await?;
            Ok(done)
        }
    }
}

/// Applies an answer to the model. `acked`: the answer arrived (a request
/// a kill cut off may or may not have taken effect).
pub fn apply(model: &mut Model, planned: &Planned, answer: &Answer, acked: bool) -> Result<(), String> {
    let got = code(answer);
    let expect = |wanted: Option<Code>| {
        if !acked || got == wanted {
            Ok(())
        } else {
            Err(format!("{planned:?}: expected {wanted:?}, got {answer:?}"))
        }
    };
    // No tier had room (a full host tier holds summaries, which never
    // migrate): refused, and nothing may have changed.
    let full = acked && got == Some(Code::ResourceExhausted);
    // Whether a write or change the plan deems `ok` (legal) took effect: an
    // illegal one is refused, and a refused full one changed nothing.
    let took_effect = |ok: bool| -> Result<bool, String> {
        if !ok {
            expect(Some(Code::FailedPrecondition))?;
            return Ok(false);
        }
        if full {
            return Ok(false);
        }
        expect(None)?;
        Ok(true)
    };
    match planned {
        Planned::Create { id, prefix, exists } => {
            if *exists {
                return expect(Some(Code::AlreadyExists));
            }
            expect(None)?;
            if !acked {
                model.created_unsure(*id, *prefix);
            } else if let Ok((attached, _)) = answer {
                let most = if prefix.is_some() { PREFIX_PAGES } else { 0 };
                if *attached > most {
                    return Err(format!("{planned:?}: {attached} pages attached"));
                }
                model.created(*id, *prefix, *attached);
            }
        }
        Planned::Write {
            id,
            layer,
            heads,
            n,
            persist,
            ok,
            ..
        } => {
            if !took_effect(*ok)? {
                return Ok(());
            }
            if let Ok((_, durability)) = answer {
                let wanted = if *persist {
                    pb::Durability::Relaxed
                } else {
                    pb::Durability::Memory
                };
                if *durability != wanted {
                    return Err(format!("{planned:?}: acknowledged {durability:?}"));
                }
            }
            model.wrote(*id, *layer, heads.clone(), *n, *persist, answer.is_ok());
        }
        Planned::Change {
            id,
            layer,
            heads,
            page,
            change,
            ok,
        } => {
            if !took_effect(*ok)? {
                return Ok(());
            }
            let fate = change.fate(pb::Reason::Explicit);
            model.changed(*id, *layer, heads.clone(), u64::from(*page), fate, answer.is_ok());
        }
        Planned::Move { .. } => {
            // Whether a move is legal depends on the tier the page is in,
            // which the model does not track; either way no byte changes.
            if acked && !matches!(got, None | Some(Code::FailedPrecondition)) {
                return Err(format!("{planned:?}: {answer:?}"));
            }
            // Only a move that happened commits the manifest.
            if acked && got.is_none() {
                model.acked(true);
            }
        }
        Planned::Policy { id, layer, change, .. } => {
            // A summary needs host room, which a host tier full of
            // summaries cannot give: refused whole, before anything changed.
            if full && matches!(change, Some(Change::Summarize)) {
                return Ok(());
            }
            expect(None)?;
            let fate = change.map(|c| c.fate(pb::Reason::Policy));
            if answer.is_ok() && acked {
                model.acked(true);
            } else {
                model.policy_unsure(*id, *layer, fate);
            }
        }
        Planned::Drop { id, exists } => {
            if !exists {
                return expect(Some(Code::NotFound));
            }
            expect(None)?;
            if acked {
                model.dropped(*id);
            } else {
                model.maybe_dropped(*id);
            }
        }
    }
    Ok(())
}
