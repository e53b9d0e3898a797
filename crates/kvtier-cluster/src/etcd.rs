//! Reaching etcd: endpoints, credentials and TLS as a node or client is
//! configured with them.

use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, TlsOptions};

/// Where the cluster's etcd is and how to talk to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `http://host:port` or `https://host:port`, one per etcd member.
    pub endpoints: Vec<String>,
    /// The cluster's name: its records live under `/kvtier/<cluster>/`.
    pub cluster: String,
    /// etcd user and password, where etcd checks them.
    pub user: Option<(String, String)>,
    /// PEM CA certificate for `https://` endpoints; `None`: plaintext.
    pub ca_pem: Option<Vec<u8>>,
    /// Each etcd request gives up after this.
    pub timeout: Duration,
}

/// The cluster name when none is given.
pub const DEFAULT_CLUSTER: &str = "default";

impl EtcdConfig {
    /// `endpoints` for the default cluster: no credentials, plaintext, a
    /// 3 s timeout.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            cluster: DEFAULT_CLUSTER.to_owned(),
            user: None,
            ca_pem: None,
            timeout: Duration::from_secs(3),
        }
    }

    /// `URL[,URL…]` as the command line takes it.
    pub fn parse_endpoints(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                if s.contains("://") {
                    s.to_owned()
                } else {
                    format!("http://{s}")
                }
            })
            .collect()
    }

    /// A client of the cluster's etcd with these settings: keep-alive pings
    /// every 10 s, and requests refused while the member has no leader.
    pub async fn connect(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_timeout(self.timeout)
            // Find a dead member's connection within seconds, not minutes;
            // etcd closes connections that ping more often than every 5 s
            // (--grpc-keepalive-min-time).
            .with_keep_alive(Duration::from_secs(10), self.timeout)
            .with_require_leader(true);
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(ca) = &self.ca_pem {
            options = options.with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(ca)));
        }
        etcd_client::Client::connect(&self.endpoints, Some(options)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_take_a_scheme_when_they_lack_one() {
        assert_eq!(
            EtcdConfig::parse_endpoints("127.0.0.1:2379, https://e2:2379,,"),
            ["http://127.0.0.1:2379", "https://e2:2379"]
        );
    }
}
