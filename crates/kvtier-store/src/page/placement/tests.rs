//! Every placement transition against an independent model of the copies
//! and against the core's state machine: random sequences of transitions,
//! fresh and stale, on pages in every state.

use std::sync::Arc;

use kvtier_core::{Action, ColdTier, PageState};
use kvtier_tiers::{ArenaTier, Slot, Tier};
use proptest::prelude::*;

use super::{AppendRefused, Change, Lost, NvmeCopy, Placement};

/// The copies a page has, as booleans: what the transitions must do,
/// written from the contract, not from the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Model {
    device: bool,
    host: bool,
    nvme: bool,
    prefix: bool,
    rows: u32,
    version: u64,
    lost: bool,
}

impl Model {
    fn state(&self) -> PageState {
        if self.lost {
            PageState::Gone
        } else if self.device {
            PageState::Hot
        } else if self.host {
            PageState::Cold(ColdTier::Host)
        } else if self.nvme {
            PageState::Cold(ColdTier::Nvme)
        } else {
            PageState::Gone
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// `stale`: the copy was taken before the last append.
    InstallDevice {
        stale: bool,
        exclusive: bool,
    },
    InstallHost {
        stale: bool,
    },
    InstallNvme {
        stale: bool,
        keep_host: bool,
    },
    DropDevice,
    DropHost,
    Append {
        rows: u32,
    },
    /// `current`: the failed copy is the page's current NVMe copy.
    LoseNvme {
        current: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<bool>(), any::<bool>()).prop_map(|(stale, exclusive)| Op::InstallDevice { stale, exclusive }),
        any::<bool>().prop_map(|stale| Op::InstallHost { stale }),
        (any::<bool>(), any::<bool>()).prop_map(|(stale, keep_host)| Op::InstallNvme { stale, keep_host }),
        Just(Op::DropDevice),
        Just(Op::DropHost),
        (1u32..4).prop_map(|rows| Op::Append { rows }),
        any::<bool>().prop_map(|current| Op::LoseNvme { current }),
    ]
}

/// The change is the model's, and a state change is one the core's state
/// machine allows by some action (a lost page went gone, as by evict).
fn check_change(change: Change, before: &Model, after: &Model) {
    assert_eq!(change.from, before.state(), "from");
    assert_eq!(change.to, after.state(), "to");
    if change.from != change.to {
        assert!(
            Action::ALL.iter().any(|a| change.from.apply(*a) == Ok(change.to)),
            "{} -> {} is no transition of the state machine",
            change.from,
            change.to
        );
    }
}

fn check_same(p: &Placement, m: &Model) {
    assert_eq!(p.device().is_some(), m.device, "device");
    assert_eq!(p.host().is_some(), m.host, "host");
    assert_eq!(p.nvme().is_some(), m.nvme, "nvme");
    assert_eq!(p.durable_prefix().is_some(), m.prefix, "durable prefix");
    assert_eq!(p.rows(), m.rows, "rows");
    assert_eq!(p.version(), m.version, "version");
    assert_eq!(p.lost().is_some(), m.lost, "lost");
    assert_eq!(p.state(), m.state(), "state");
    // The invariant: a page that is not lost has a copy.
    assert!(m.lost || m.device || m.host || m.nvme, "no copy left: {m:?}");
}

struct Tiers {
    tier: ArenaTier,
}

impl Tiers {
    fn slot(&self) -> Slot {
        self.tier.allocate(64).expect("room")
    }

    fn nvme(&self, rows: u32) -> NvmeCopy {
        NvmeCopy {
            slot: Arc::new(self.slot()),
            crc: 0,
            rows,
        }
    }
}

/// Applies `op` to the placement and the model; checks they agree.
fn step(tiers: &Tiers, p: &mut Placement, m: &mut Model, op: Op) {
    let before = *m;
    let version = |stale: bool| {
        if stale {
            p.version().wrapping_sub(1)
        } else {
            p.version()
        }
    };
    // A copy taken before the last append is refused.
    let fresh = |stale: bool| !stale;
    match op {
        Op::InstallDevice { stale, exclusive } => {
            let ok = !m.device && !m.lost && fresh(stale);
            let v = version(stale);
            match p.install_device(tiers.slot(), v, exclusive) {
                Ok((change, freed)) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    m.device = true;
                    assert_eq!(freed.is_some(), exclusive && before.host, "host copy freed");
                    m.host &= !exclusive;
                    check_change(change, &before, m);
                }
                Err(_) => assert!(!ok, "refused {op:?} on {before:?}"),
            }
        }
        Op::InstallHost { stale } => {
            let ok = !m.host && !m.lost && fresh(stale);
            let v = version(stale);
            match p.install_host(tiers.slot(), v) {
                Ok(change) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    m.host = true;
                    check_change(change, &before, m);
                }
                Err(_) => assert!(!ok, "refused {op:?} on {before:?}"),
            }
        }
        Op::InstallNvme { stale, keep_host } => {
            let ok = !m.nvme && !m.lost && fresh(stale);
            let v = version(stale);
            match p.install_nvme(tiers.nvme(m.rows), v, keep_host) {
                Ok(done) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    m.nvme = true;
                    assert_eq!(done.superseded.is_some(), before.prefix, "prefix superseded");
                    m.prefix = false;
                    assert_eq!(done.dropped_host.is_some(), before.host && !keep_host, "host dropped");
                    m.host &= keep_host;
                    check_change(done.change, &before, m);
                }
                Err(_) => assert!(!ok, "refused {op:?} on {before:?}"),
            }
        }
        Op::DropDevice => {
            let ok = m.device && (m.host || m.nvme);
            match p.drop_device() {
                Some((change, _)) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    m.device = false;
                    check_change(change, &before, m);
                }
                None => assert!(!ok, "refused {op:?} on {before:?}"),
            }
        }
        Op::DropHost => {
            let ok = m.host && m.nvme;
            match p.drop_host() {
                Some((change, _)) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    m.host = false;
                    check_change(change, &before, m);
                }
                None => assert!(!ok, "refused {op:?} on {before:?}"),
            }
        }
        Op::Append { rows } => {
            let ok = m.host || m.device;
            let mut written = Vec::new();
            match p.append_rows(rows, |copy, _| {
                written.push(copy);
                Ok::<_, ()>(())
            }) {
                Ok(change) => {
                    assert!(ok, "accepted {op:?} on {before:?}");
                    assert_eq!(
                        written.len(),
                        usize::from(m.host) + usize::from(m.device),
                        "copies written"
                    );
                    if m.nvme {
                        m.prefix = true;
                    }
                    m.nvme = false;
                    m.rows += rows;
                    m.version += 1;
                    check_change(change, &before, m);
                }
                Err(AppendRefused::NoMemoryCopy) => assert!(!ok, "refused {op:?} on {before:?}"),
                Err(AppendRefused::Write(())) => unreachable!("the writer never fails"),
            }
        }
        Op::LoseNvme { current } => {
            let failed = match (current, p.nvme()) {
                (true, Some(copy)) => Arc::clone(&copy.slot),
                _ => Arc::new(tiers.slot()),
            };
            let only_copy = current && m.nvme && !m.host && !m.device;
            match p.lose_nvme_copy(&failed) {
                Lost::Now { change, failed: slot } => {
                    assert!(!m.lost && only_copy, "lost {op:?} on {before:?}");
                    assert!(Arc::ptr_eq(&slot, &failed));
                    m.lost = true;
                    m.nvme = false;
                    check_change(change, &before, m);
                }
                Lost::Already => assert!(m.lost, "already lost: {before:?}"),
                Lost::Elsewhere => assert!(!m.lost && !only_copy, "{op:?} on {before:?}"),
            }
        }
    }
    check_same(p, m);
}

fn start(tiers: &Tiers, kind: u8) -> (Placement, Model) {
    let none = Model {
        device: false,
        host: false,
        nvme: false,
        prefix: false,
        rows: 4,
        version: 0,
        lost: false,
    };
    match kind {
        0 => (Placement::written(None, tiers.slot(), 4), Model { host: true, ..none }),
        1 => (
            Placement::written(Some(tiers.slot()), tiers.slot(), 4),
            Model {
                host: true,
                device: true,
                ..none
            },
        ),
        _ => (Placement::recovered(tiers.nvme(4)), Model { nvme: true, ..none }),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn transitions_follow_the_model_and_the_state_machine(kind in 0u8..3, ops in prop::collection::vec(op(), 1..40)) {
        let tiers = Tiers { tier: ArenaTier::host(1 << 20).unwrap() };
        let (mut p, mut m) = start(&tiers, kind);
        check_same(&p, &m);
        for op in ops {
            step(&tiers, &mut p, &mut m, op);
        }
    }
}

/// A refused install hands back the slot it was offered.
#[test]
fn a_refused_install_hands_its_slot_back() {
    let tiers = Tiers {
        tier: ArenaTier::host(1 << 20).unwrap(),
    };
    let (mut p, _) = start(&tiers, 1);
    let offered = tiers.slot();
    let offset = offered.offset();
    let back = p.install_device(offered, p.version(), false).unwrap_err();
    assert_eq!(back.offset(), offset);
}
