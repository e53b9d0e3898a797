//! `ApplyPolicy` and `ReportAttention`: a policy request converted to the
//! store's spec (scorer, allocator, action and trigger, each field checked
//! and named when wrong), and attention reported for the policies' scores.

use kvtier_core::policy::{Allocator, Pooling, Scorer, Window};
use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use kvtier_store::{ApplyPolicy, AttentionWeights, PolicyAction, PolicySpec, ReportAttention, Trigger};
use tonic::{Request, Response, Status};

use super::{KvTierService, open_seq};
use crate::convert;
use crate::moves::Access;
use crate::status::invalid;

pub(super) async fn apply_policy(
    svc: &KvTierService,
    request: Request<pb::ApplyPolicyRequest>,
) -> Result<Response<pb::ApplyPolicyResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
        .await?;
    let Some((spec, trigger)) = spec(&r)? else {
        svc.call(move |s| s.unregister_policy(&key)).await?;
        return Ok(Response::new(pb::ApplyPolicyResponse::default()));
    };
    let queries = convert::f32s(wire::QUERIES, &r.queries)?;
    let outcome = svc
        .call(move |s| {
            s.apply_policy(
                &key,
                ApplyPolicy {
                    spec: &spec,
                    queries: &queries,
                    trigger,
                },
            )
        })
        .await?;
    Ok(Response::new(pb::ApplyPolicyResponse {
        pages_kept: outcome.kept,
        pages_changed: outcome.changed,
        dropped_mass: outcome.dropped_mass,
    }))
}

pub(super) async fn report_attention(
    svc: &KvTierService,
    request: Request<pb::ReportAttentionRequest>,
) -> Result<Response<pb::ReportAttentionResponse>, Status> {
    let (caller, incarnation, r) = open_seq(request)?;
    let (key, _permit) = svc
        .located(&caller, &r.tenant, &r.sequence_id, incarnation, Access::Write)
        .await?;
    if r.token_weights.is_empty() == r.page_weights.is_empty() {
        return Err(invalid(
            wire::TOKEN_WEIGHTS,
            "give either token_weights or page_weights",
        ));
    }
    svc.call(move |s| {
        s.report_attention(
            &key,
            ReportAttention {
                layer: r.layer,
                heads: convert::heads(r.kv_head_start, r.kv_head_count),
                weights: if r.page_weights.is_empty() {
                    AttentionWeights::Tokens(&r.token_weights)
                } else {
                    AttentionWeights::Pages(&r.page_weights)
                },
                decay: (r.decay != 0.0).then_some(r.decay),
            },
        )
    })
    .await?;
    Ok(Response::new(pb::ReportAttentionResponse {}))
}

fn defaults(name: &str) -> Scorer {
    Scorer::defaults(name).expect("every scorer has defaults")
}

/// `n` tokens, or the reference default when 0.
fn window(n: u32, default: Window) -> Window {
    if n == 0 { default } else { Window::Tokens(n) }
}

fn or_default(n: u32, default: u32) -> u32 {
    if n == 0 { default } else { n }
}

fn scorer(policy: &pb::Policy) -> Result<Scorer, Status> {
    use pb::policy::Scorer as S;
    let scorer = policy.scorer.as_ref().ok_or_else(|| {
        invalid(
            wire::POLICY_SCORER,
            "is required (streaming, h2o, snapkv, tova, scissorhands or max_mass)",
        )
    })?;
    Ok(match (scorer, defaults(scorer_name(scorer))) {
        (S::Streaming(p), Scorer::Streaming { sink_tokens }) => Scorer::Streaming {
            sink_tokens: or_default(p.sink_tokens, sink_tokens),
        },
        (S::H2o(p), Scorer::H2o { window: w, .. }) => Scorer::H2o {
            window: window(p.window_tokens, w),
            normalize: p.normalize,
        },
        (
            S::Snapkv(p),
            Scorer::SnapKv {
                window_tokens, kernel, ..
            },
        ) => {
            let kernel = or_default(p.kernel, kernel);
            if kernel.is_multiple_of(2) {
                return Err(invalid(
                    wire::POLICY_SNAPKV_KERNEL,
                    format!("is {kernel}; it must be odd"),
                ));
            }
            Scorer::SnapKv {
                window_tokens: or_default(p.window_tokens, window_tokens),
                kernel,
                pooling: if p.avg_pool { Pooling::Avg } else { Pooling::Max },
            }
        }
        (S::Tova(p), Scorer::Tova { window: w }) => Scorer::Tova {
            window: window(p.window_tokens, w),
        },
        (S::Scissorhands(p), Scorer::Scissorhands { window: w }) => Scorer::Scissorhands {
            window: window(p.window_tokens, w),
        },
        (S::MaxMass(_), scorer) => scorer,
        _ => unreachable!("defaults are looked up by the same scorer's name"),
    })
}

fn scorer_name(scorer: &pb::policy::Scorer) -> &'static str {
    use pb::policy::Scorer as S;
    match scorer {
        S::Streaming(_) => "streaming",
        S::H2o(_) => "h2o",
        S::Snapkv(_) => "snapkv",
        S::Tova(_) => "tova",
        S::Scissorhands(_) => "scissorhands",
        S::MaxMass(_) => "max-mass",
    }
}

fn allocator(policy: &pb::Policy) -> Result<Allocator, Status> {
    use pb::policy::Allocator as A;
    let positive = |field: wire::Field, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(invalid(field, format!("is {v}; it must be finite and not negative")))
        }
    };
    Ok(match &policy.allocator {
        None | Some(A::Uniform(_)) => Allocator::Uniform,
        Some(A::Pyramid(p)) => match positive(wire::POLICY_PYRAMID_BETA, p.beta)? {
            0.0 => Allocator::defaults("pyramid").expect("known"),
            beta => Allocator::Pyramid { beta },
        },
        Some(A::Ada(a)) => match positive(wire::POLICY_ADA_FLOOR, a.floor)? {
            0.0 => Allocator::defaults("ada").expect("known"),
            floor if floor > 1.0 => {
                return Err(invalid(
                    wire::POLICY_ADA_FLOOR,
                    format!("is {floor}; it must be at most 1"),
                ));
            }
            floor => Allocator::Ada { floor },
        },
    })
}

fn action(action: Option<&pb::apply_policy_request::Action>) -> Result<PolicyAction, Status> {
    use pb::apply_policy_request::Action as A;
    match action {
        None => Err(invalid(wire::ACTION, "is required (offload, summarize or evict)")),
        Some(A::Offload(o)) => Ok(PolicyAction::Offload(crate::convert::cold_tier(
            wire::OFFLOAD_TIER,
            o.tier,
        )?)),
        Some(A::Summarize(s)) if s.rows == 0 => Err(invalid(wire::SUMMARIZE_ROWS, "must be at least 1")),
        Some(A::Summarize(s)) => Ok(PolicyAction::Summarize { rows: s.rows }),
        Some(A::Evict(_)) => Ok(PolicyAction::Evict),
    }
}

/// When the policy runs; `None` for TRIGGER_OFF.
fn trigger(value: i32, every_tokens: u32) -> Result<Option<Trigger>, Status> {
    let trigger = match pb::Trigger::try_from(value) {
        Ok(pb::Trigger::Unspecified | pb::Trigger::Now) => Some(Trigger::Now),
        Ok(pb::Trigger::AfterPrefill) => Some(Trigger::AfterPrefill),
        Ok(pb::Trigger::EveryTokens) if every_tokens == 0 => {
            return Err(invalid(
                wire::EVERY_TOKENS,
                "must be at least 1 with TRIGGER_EVERY_TOKENS",
            ));
        }
        Ok(pb::Trigger::EveryTokens) => Some(Trigger::EveryTokens(every_tokens)),
        Ok(pb::Trigger::Off) => None,
        Err(_) => {
            return Err(invalid(
                wire::TRIGGER,
                format!("{value} is not one of TRIGGER_NOW, TRIGGER_AFTER_PREFILL, TRIGGER_EVERY_TOKENS, TRIGGER_OFF"),
            ));
        }
    };
    if every_tokens != 0 && !matches!(trigger, Some(Trigger::EveryTokens(_))) {
        return Err(invalid(wire::EVERY_TOKENS, "is only for TRIGGER_EVERY_TOKENS"));
    }
    Ok(trigger)
}

/// The policy a request applies or registers, and when; `None` for
/// TRIGGER_OFF (unregister).
pub(crate) fn spec(r: &pb::ApplyPolicyRequest) -> Result<Option<(PolicySpec, Trigger)>, Status> {
    let Some(trigger) = trigger(r.trigger, r.every_tokens)? else {
        return Ok(None);
    };
    let policy = r
        .policy
        .as_ref()
        .ok_or_else(|| invalid(wire::POLICY_SPEC, "is required"))?;
    Ok(Some((
        PolicySpec {
            layer_start: r.layer_start,
            layer_count: r.layer_count,
            scorer: scorer(policy)?,
            allocator: allocator(policy)?,
            budget_tokens: r.budget_tokens,
            action: action(r.action.as_ref())?,
        },
        trigger,
    )))
}
