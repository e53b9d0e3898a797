//! `kvtier health`: asks a server's gRPC health service whether kvtier.v1
//! is serving; exits 0 if it is (a container's `HEALTHCHECK`, a readiness
//! probe).

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Debug, Args)]
pub(crate) struct HealthArgs {
    /// The server's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    addr: String,
    /// The service to ask about ("" for the server as a whole).
    #[arg(long, default_value = "kvtier.v1.KvTier")]
    service: String,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
}

pub(crate) fn run(args: HealthArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let status = runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(args.addr.clone())?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect()
            .await
            .with_context(|| format!("connecting to {}", args.addr))?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: args.service.clone(),
            })
            .await
            .with_context(|| format!("asking {} about {:?}", args.addr, args.service))?;
        anyhow::Ok(reply.into_inner().status())
    })?;
    match status {
        ServingStatus::Serving => {
            println!("{} at {}: serving", display(&args.service), args.addr);
            Ok(())
        }
        other => bail!("{} at {}: {}", display(&args.service), args.addr, other.as_str_name()),
    }
}

fn display(service: &str) -> &str {
    if service.is_empty() { "the server" } else { service }
}
