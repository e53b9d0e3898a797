//! `SetAccessTrace` (admin only): a start request becomes a recording's
//! settings (the server names the file), a status its message.

use kvtier_core::wire;
use kvtier_proto::v1 as pb;
use kvtier_store::{TraceConfig, TraceStatus};
use tonic::{Request, Response, Status};

use super::{KvTierService, open};
use crate::status::{invalid, to_status};

/// Where `SetAccessTrace` records, and its default size bound.
#[derive(Debug, Clone)]
pub(crate) struct TraceSettings {
    pub(crate) dir: Option<std::path::PathBuf>,
    pub(crate) max_bytes: u64,
}

pub(super) async fn set_access_trace(
    svc: &KvTierService,
    request: Request<pb::SetAccessTraceRequest>,
) -> Result<Response<pb::AccessTraceStatus>, Status> {
    let (caller, r) = open(request)?;
    caller.check_admin("SetAccessTrace")?;
    let status = match r.record {
        true => {
            let config = config(&r, &svc.traces)?;
            Some(svc.call(move |s| s.start_access_trace(config)).await?)
        }
        false => {
            check_stop(&r)?;
            svc.call(|s| Ok(s.stop_access_trace())).await?
        }
    };
    Ok(Response::new(status_to_pb(status)))
}

/// A start request's recording: sampled as asked, bounded as asked or by
/// the server's default, in a new file under the server's trace directory
/// (created by the store, once it accepts the recording).
pub(crate) fn config(r: &pb::SetAccessTraceRequest, settings: &TraceSettings) -> Result<TraceConfig, Status> {
    let sample = if r.sample_rate == 0.0 { 1.0 } else { r.sample_rate };
    kvtier_store::check_sample(sample).map_err(to_status)?;
    let dir = settings.dir.as_ref().ok_or_else(|| {
        Status::failed_precondition(format!(
            "{}: this server has no trace directory (set access_trace.dir)",
            wire::RECORD.path
        ))
    })?;
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    // A new name: an earlier recording (started in the same millisecond) is
    // never overwritten.
    let mut path = dir.join(format!("access-{millis}.trace"));
    for n in 1.. {
        if !path.exists() {
            break;
        }
        path = dir.join(format!("access-{millis}-{n}.trace"));
    }
    Ok(TraceConfig {
        path,
        sample,
        max_bytes: match r.max_bytes {
            0 => settings.max_bytes,
            n => n,
        },
    })
}

/// A stop request sets nothing else.
pub(crate) fn check_stop(r: &pb::SetAccessTraceRequest) -> Result<(), Status> {
    for (set, field) in [
        (r.sample_rate != 0.0, wire::SAMPLE_RATE),
        (r.max_bytes != 0, wire::MAX_BYTES),
    ] {
        if set {
            return Err(invalid(field, "applies to starting a recording; set record too"));
        }
    }
    Ok(())
}

pub(crate) fn status_to_pb(status: Option<TraceStatus>) -> pb::AccessTraceStatus {
    let Some(s) = status else {
        return pb::AccessTraceStatus::default();
    };
    pb::AccessTraceStatus {
        recording: s.recording,
        path: s.config.path.display().to_string(),
        sample_rate: s.config.sample,
        max_bytes: s.config.max_bytes,
        records: s.records,
        bytes: s.bytes,
        dropped: s.dropped,
        full: s.full,
    }
}
