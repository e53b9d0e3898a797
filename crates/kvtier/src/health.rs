//! `kvtier health`: asks a server's gRPC health service whether kvtier.v1
//! is serving; exits 0 if it is (a container's `HEALTHCHECK`, a readiness
//! probe). With `--config`, it asks the server that config file starts, as
//! that server listens: its port, over TLS where it has TLS.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::config::FileConfig;

/// Where health asks when nothing says otherwise.
const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

#[derive(Debug, Args)]
pub(crate) struct HealthArgs {
    /// The server's TOML configuration: asks on its `listen` port (on
    /// loopback when it listens on all interfaces), over TLS when it has a
    /// `[tls]` section, trusting `[tls] ca` (default: the certificate itself)
    /// for the name `[tls] domain` (default: localhost). Flags override it.
    #[arg(long, value_name = "FILE", env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// The server's gRPC address, `http://` or `https://` [default: http://127.0.0.1:50051].
    #[arg(long, value_name = "URL")]
    addr: Option<String>,
    /// PEM authority to check an `https://` server's certificate against.
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// The name the server's certificate must carry [default: the address's host].
    #[arg(long, value_name = "NAME")]
    tls_domain: Option<String>,
    /// The service to ask about ("" for the server as a whole).
    #[arg(long, default_value = "kvtier.v1.KvTier")]
    service: String,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
}

/// Where and how to ask.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    addr: String,
    ca: Option<PathBuf>,
    domain: Option<String>,
}

/// The address a client on this machine reaches a listener on: an
/// unspecified address (all interfaces) is asked on loopback.
fn local_addr(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

fn target(args: &HealthArgs) -> anyhow::Result<Target> {
    let mut target = Target {
        addr: DEFAULT_ADDR.to_owned(),
        ca: None,
        domain: None,
    };
    if let Some(path) = &args.config {
        let file = FileConfig::load(path)?;
        let listen = local_addr(file.listen.unwrap_or(kvtier_server::ServerConfig::default().listen));
        target.addr = match &file.tls {
            Some(tls) => {
                target.ca = Some(tls.ca.clone().unwrap_or_else(|| tls.cert.clone()));
                target.domain = Some(tls.domain.clone().unwrap_or_else(|| "localhost".to_owned()));
                format!("https://{listen}")
            }
            None => format!("http://{listen}"),
        };
    }
    if let Some(addr) = &args.addr {
        target.addr.clone_from(addr);
    }
    if args.ca.is_some() {
        target.ca.clone_from(&args.ca);
    }
    if args.tls_domain.is_some() {
        target.domain.clone_from(&args.tls_domain);
    }
    Ok(target)
}

fn endpoint(target: &Target, timeout: Duration) -> anyhow::Result<Endpoint> {
    let mut endpoint = Endpoint::from_shared(target.addr.clone())
        .with_context(|| format!("--addr: {:?} is not a URL", target.addr))?
        .connect_timeout(timeout)
        .timeout(timeout);
    if target.addr.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &target.ca {
            let pem = std::fs::read(ca).with_context(|| format!("reading the TLS authority {}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let Some(domain) = &target.domain {
            tls = tls.domain_name(domain.clone());
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint)
}

pub(crate) fn run(args: HealthArgs) -> anyhow::Result<()> {
    let target = target(&args)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let endpoint = endpoint(&target, timeout)?;
    let addr = &target.addr;
    let status = runtime.block_on(async {
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: args.service.clone(),
            })
            .await
            .with_context(|| format!("asking {addr} about {:?}", args.service))?;
        anyhow::Ok(reply.into_inner().status())
    })?;
    match status {
        ServingStatus::Serving => {
            println!("{} at {addr}: serving", display(&args.service));
            Ok(())
        }
        other => bail!("{} at {addr}: {}", display(&args.service), other.as_str_name()),
    }
}

fn display(service: &str) -> &str {
    if service.is_empty() { "the server" } else { service }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_interfaces_are_asked_on_loopback() {
        assert_eq!(local_addr("0.0.0.0:5".parse().unwrap()), "127.0.0.1:5".parse().unwrap());
        assert_eq!(local_addr("[::]:5".parse().unwrap()), "[::1]:5".parse().unwrap());
        assert_eq!(local_addr("10.1.2.3:5".parse().unwrap()), "10.1.2.3:5".parse().unwrap());
    }
}
