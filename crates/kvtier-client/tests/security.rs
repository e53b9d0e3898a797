//! Tokens and TLS with a real rustls client: the right token works, a wrong
//! or missing one is UNAUTHENTICATED, another tenant's sequence, lease or
//! statistics are PERMISSION_DENIED (or, for a lease, not there), and a
//! server refuses to listen off loopback unprotected.

mod common;

use common::{TestServer, small_store};
use kvtier_client::{Client, ClientError, Connect, SelectRequest, Tls, pb};
use kvtier_core::TenantId;
use kvtier_server::{Auth, BoundServer, Grant, ServerConfig, ServerError, TlsFiles, Token};
use kvtier_store::Store;
use tonic::Code;

const TOKEN_A: &str = "token-of-tenant-a-0123456789";
const TOKEN_B: &str = "token-of-tenant-b-0123456789";
const ADMIN: &str = "token-of-the-admin-0123456789";

fn tls_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tls")
}

fn secure_config() -> ServerConfig {
    let tenant = |name| Grant::Tenant(TenantId::parse("tenant", name).unwrap());
    ServerConfig {
        auth: Auth::new(vec![
            Token {
                secret: TOKEN_A.into(),
                grant: tenant("a"),
            },
            Token {
                secret: TOKEN_B.into(),
                grant: tenant("b"),
            },
            Token {
                secret: ADMIN.into(),
                grant: Grant::Admin,
            },
        ]),
        tls: Some(TlsFiles {
            cert: tls_dir().join("server.pem"),
            key: tls_dir().join("server.key"),
        }),
        ..ServerConfig::default()
    }
}

async fn connect(server: &TestServer, token: Option<&str>, tenant: &str) -> Client {
    let options = Connect {
        token: token.map(str::to_owned),
        tls: Some(Tls {
            ca_pem: std::fs::read(tls_dir().join("ca.pem")).unwrap(),
            domain: Some("localhost".into()),
        }),
    };
    Client::connect_with(format!("https://{}", server.addr), options)
        .await
        .unwrap()
        .with_tenant(tenant)
}

fn code<T: std::fmt::Debug>(result: Result<T, ClientError>) -> (Code, String) {
    match result {
        Err(ClientError::Status(s)) => (s.code(), s.message().to_owned()),
        other => panic!("expected a status, got {other:?}"),
    }
}

fn layout() -> pb::Layout {
    kvtier_client::layout(1, 1, 1, 4, pb::DType::DtypeF32, 4)
}

#[tokio::test]
async fn tokens_over_tls_give_each_tenant_its_own_and_nothing_else() {
    let server = TestServer::start_with(small_store(), secure_config()).await;
    let mut a = connect(&server, Some(TOKEN_A), "a").await;
    a.create_sequence("s", layout(), vec![]).await.unwrap();
    a.put_pages("s", 0, 0..1, 0, 8, vec![0u8; 2 * 8 * 4 * 4].into())
        .await
        .unwrap();
    let chosen = a
        .select_pages(
            "s",
            &SelectRequest {
                lease_ms: 60_000,
                ..SelectRequest::new(0, 0..1, vec![1.0; 4], 1)
            },
        )
        .await
        .unwrap();
    let (lease, _) = chosen.lease.expect("a lease");

    // No token, a wrong token: UNAUTHENTICATED, for every call.
    let mut anonymous = connect(&server, None, "a").await;
    let (c, m) = code(anonymous.get_sequence("s").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let mut forger = connect(&server, Some("token-of-tenant-a-0123456780"), "a").await;
    let (c, m) = code(forger.get_sequence("s").await);
    assert_eq!(c, Code::Unauthenticated, "{m}");
    let (c, _) = code(forger.stats().await);
    assert_eq!(c, Code::Unauthenticated);

    // Tenant b's token on tenant a's sequence, lease and statistics.
    let mut b_as_a = connect(&server, Some(TOKEN_B), "a").await;
    let (c, m) = code(b_as_a.get_sequence("s").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.starts_with("tenant:"), "names the field: {m}");
    let (c, _) = code(b_as_a.fetch_pages("s", 0, 0..1, vec![]).await);
    assert_eq!(c, Code::PermissionDenied);
    let (c, _) = code(b_as_a.drop_sequence("s").await);
    assert_eq!(c, Code::PermissionDenied);
    let (c, _) = code(b_as_a.release_lease(lease).await);
    assert_eq!(c, Code::PermissionDenied);
    let (c, _) = code(b_as_a.tenant_stats().await);
    assert_eq!(c, Code::PermissionDenied);
    // ... and as itself: a's lease is not b's to release, a's sequence not
    // b's to see.
    let mut b = connect(&server, Some(TOKEN_B), "b").await;
    let (c, m) = code(b.release_lease(lease).await);
    assert_eq!(c, Code::NotFound, "{m}");
    let (c, _) = code(b.get_sequence("s").await);
    assert_eq!(c, Code::NotFound);
    let stats = b.stats().await.unwrap();
    assert_eq!((stats.tenant.as_str(), stats.sequences), ("b", 0), "scoped to b");
    assert!(stats.tiers.is_empty(), "a tenant does not see the server's tiers");

    // Tenant a sees its own, and releases its own lease once.
    let stats = a.stats().await.unwrap();
    assert_eq!((stats.tenant.as_str(), stats.sequences), ("a", 1));
    a.release_lease(lease).await.unwrap();
    let (c, _) = code(a.release_lease(lease).await);
    assert_eq!(c, Code::NotFound);

    // The admin sees the whole server and may act for any tenant.
    let mut admin = connect(&server, Some(ADMIN), "a").await;
    let stats = admin.stats().await.unwrap();
    assert_eq!((stats.tenant.as_str(), stats.sequences), ("", 1));
    assert!(!stats.tiers.is_empty());
    admin.get_sequence("s").await.unwrap();

    // Nothing a refused call touched changed.
    let info = a.get_sequence("s").await.unwrap();
    assert_eq!(info.tokens, 8);
}

#[tokio::test]
async fn lease_ids_are_not_sequential() {
    let server = TestServer::default().await;
    let mut c = server.client().await;
    c.create_sequence("s", layout(), vec![]).await.unwrap();
    c.put_pages("s", 0, 0..1, 0, 8, vec![0u8; 2 * 8 * 4 * 4].into())
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..8 {
        let req = SelectRequest {
            lease_ms: 60_000,
            ..SelectRequest::new(0, 0..1, vec![1.0; 4], 1)
        };
        ids.push(c.select_pages("s", &req).await.unwrap().lease.unwrap().0);
    }
    let close = ids.windows(2).filter(|w| w[0].abs_diff(w[1]) < 1 << 32).count();
    assert_eq!(close, 0, "consecutive lease ids close together: {ids:?}");
}

#[tokio::test]
async fn a_server_refuses_to_listen_off_loopback_unprotected() {
    let exposed = |config: ServerConfig| ServerConfig {
        listen: ([0, 0, 0, 0], 0).into(),
        metrics_listen: None,
        ..config
    };
    for (config, why) in [
        (ServerConfig::default(), "neither"),
        (
            ServerConfig {
                tls: None,
                ..secure_config()
            },
            "TLS",
        ),
        (
            ServerConfig {
                auth: Auth::default(),
                ..secure_config()
            },
            "tokens",
        ),
    ] {
        let store = Store::new(small_store()).unwrap();
        let err = BoundServer::bind(store, exposed(config)).await.unwrap_err();
        assert!(matches!(err, ServerError::Exposed { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("--insecure") && text.contains(why), "{text}");
    }
    // Protected, or explicitly insecure: it starts.
    for config in [
        secure_config(),
        ServerConfig {
            insecure: true,
            ..ServerConfig::default()
        },
    ] {
        let store = Store::new(small_store()).unwrap();
        BoundServer::bind(store, exposed(config)).await.unwrap();
    }
    // Metrics serve under the gRPC port's TLS and tokens: off loopback on
    // the same terms.
    let metrics_exposed = |config: ServerConfig| ServerConfig {
        metrics_listen: Some(([0, 0, 0, 0], 0).into()),
        ..config
    };
    let store = Store::new(small_store()).unwrap();
    let unprotected = ServerConfig {
        tls: None,
        ..secure_config()
    };
    let err = BoundServer::bind(store, metrics_exposed(unprotected))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("metrics") && err.to_string().contains("TLS"),
        "{err}"
    );
    let store = Store::new(small_store()).unwrap();
    BoundServer::bind(store, metrics_exposed(secure_config()))
        .await
        .unwrap();
}

/// One HTTP/1.1 GET of /metrics over TLS (checked against the test CA for
/// `localhost`), with `token` as a bearer token; the status code.
async fn scrape(addr: std::net::SocketAddr, token: Option<&str>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut roots = RootCertStore::empty();
    let ca = std::fs::read(tls_dir().join("ca.pem")).unwrap();
    for cert in CertificateDer::pem_slice_iter(&ca) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let mut tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let request = format!("GET /metrics HTTP/1.1\r\nhost: localhost\r\n{auth}connection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    tls.read_to_string(&mut reply).await.unwrap();
    let status = reply.split_whitespace().nth(1).unwrap().parse().unwrap();
    if status == 200 {
        assert!(reply.contains("kvtier_sequences"), "{reply}");
    }
    status
}

/// A server of `config` serving until `stop` is sent: its metrics address,
/// the stop, and the serving task.
async fn serve_metrics(
    config: ServerConfig,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), ServerError>>,
) {
    let bound = BoundServer::bind(Store::new(small_store()).unwrap(), config)
        .await
        .unwrap();
    let addr = bound.metrics_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(bound.serve(async {
        let _ = stopped.await;
    }));
    (addr, stop, serving)
}

#[tokio::test]
async fn metrics_serve_under_the_grpc_ports_tls_and_only_to_an_admin_token() {
    let config = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: Some(([127, 0, 0, 1], 0).into()),
        ..secure_config()
    };
    let (addr, stop, serving) = serve_metrics(config).await;
    assert_eq!(scrape(addr, None).await, 401);
    assert_eq!(scrape(addr, Some("token-of-nobody-0123456789")).await, 401);
    assert_eq!(scrape(addr, Some(TOKEN_A)).await, 403);
    assert_eq!(scrape(addr, Some(ADMIN)).await, 200);
    // Plaintext HTTP gets no metrics from a TLS port.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut reply = Vec::new();
        let _ = tcp.read_to_end(&mut reply).await;
        assert!(
            !String::from_utf8_lossy(&reply).contains("kvtier_"),
            "plaintext got metrics"
        );
    }
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}

/// A plaintext scrape's status code, or `None` when the server closed the
/// connection without answering.
async fn scrape_plain(addr: std::net::SocketAddr) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut reply = String::new();
    tcp.read_to_string(&mut reply).await.ok()?;
    reply.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test]
async fn slow_metrics_clients_neither_block_scrapes_nor_hold_up_a_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: Some(([127, 0, 0, 1], 0).into()),
        ..ServerConfig::default()
    };
    let (addr, stop, serving) = serve_metrics(config).await;
    // A client in the middle of its request, and others that say nothing,
    // up to the connection limit less one.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut idle = Vec::new();
    for _ in 0..30 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // The last slot still serves a scrape.
    assert_eq!(scrape_plain(addr).await, Some(200));
    // With every slot held (once the scrape's connection is gone), a new
    // connection is closed unanswered.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let _last = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut beyond = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), beyond.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "a connection past the limit was kept: {read:?}"
    );
    // A shutdown does not wait for the slow client (whose connection would
    // live 30 s): the watchdog is far below that.
    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), serving)
        .await
        .expect("the shutdown waited for a slow metrics client")
        .unwrap()
        .unwrap();
    drop((slow, idle));
}
