//! `kvtier serve` with embedded defaults, as a newcomer runs it: the real
//! binary, in a fresh directory, answering health, reflection and metrics,
//! and stopping cleanly on SIGTERM.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const GRPC: &str = "127.0.0.1:50051";
const METRICS: &str = "127.0.0.1:9464";

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

async fn channel() -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_static("http://127.0.0.1:50051")
        .connect()
        .await
}

async fn wait_for_health(deadline: Instant) -> ServingStatus {
    loop {
        if let Ok(channel) = channel().await {
            let mut health = HealthClient::new(channel);
            let req = HealthCheckRequest {
                service: "kvtier.v1.KvTier".into(),
            };
            if let Ok(resp) = health.check(req).await {
                return resp.into_inner().status();
            }
        }
        assert!(
            Instant::now() < deadline,
            "kvtier serve did not answer the health check in time"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_defaults_answers_health_reflection_and_metrics() {
    for addr in [GRPC, METRICS] {
        assert!(
            TcpListener::bind(addr).is_ok(),
            "{addr} is in use; this test runs the server's default ports"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("serve")
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);

    let status = wait_for_health(Instant::now() + Duration::from_secs(30)).await;
    assert_eq!(status, ServingStatus::Serving);
    // `kvtier health` (the Docker image's HEALTHCHECK) says so too, and
    // fails where nothing serves.
    let health = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("health")
            .args(args)
            .output()
            .unwrap()
    };
    let up = health(&[]);
    assert!(up.status.success(), "{}", String::from_utf8_lossy(&up.stderr));
    let down = health(&["--addr", "http://127.0.0.1:1", "--timeout-ms", "500"]);
    assert!(!down.status.success());
    assert!(String::from_utf8_lossy(&down.stderr).contains("127.0.0.1:1"));
    assert!(
        dir.path().join("kvtier-data").is_dir(),
        "data directory under the working directory"
    );

    let mut reflection = ServerReflectionClient::new(channel().await.unwrap());
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        responses.message().await.unwrap().unwrap().message_response
    else {
        panic!("reflection did not list services");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"kvtier.v1.KvTier"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");

    let mut http = TcpStream::connect(METRICS).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    http.read_to_string(&mut body).unwrap();
    assert!(
        body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200"),
        "{body}"
    );
    assert!(
        body.contains("kvtier_tier_capacity_bytes{tier=\"device\",backend=\"emulated\",emulated=\"true\"}"),
        "{body}"
    );
    // The default metadata budget: a quarter of host + NVMe (capped by the
    // memory available at start, which this test cannot know), at least 1 GiB.
    // The tiers' reported capacities are their configured sizes rounded to
    // their block sizes, hence the slack.
    let gauge = |prefix: &str| -> u64 {
        let line = body
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix}: {body}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let tiers = gauge("kvtier_tier_capacity_bytes{tier=\"host\"") + gauge("kvtier_tier_capacity_bytes{tier=\"nvme\"");
    let limit = gauge("kvtier_metadata_limit_bytes ");
    assert!(
        (1 << 30..=(tiers / 4).max(1 << 30) + (1 << 20)).contains(&limit),
        "{limit}: {body}"
    );

    // SIGTERM: a graceful stop with exit status 0.
    let pid = server.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "kvtier serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    server.0.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(exit.success(), "exit {exit:?}; log:\n{log}");
    assert!(
        log.contains("the device tier is emulated"),
        "the emulated device is announced:\n{log}"
    );
    assert!(log.contains("SIGTERM"), "{log}");
}

/// Runs `kvtier serve` with `args` (no metrics, no NVMe, data in `dir`),
/// expecting it to refuse to start; its stderr.
fn refused(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("serve")
        .args(args)
        .args(["--metrics-listen", "off", "--nvme-bytes", "0"])
        .args(["--data-dir", dir.to_str().unwrap()])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "it started with {args:?}:\n{stderr}");
    stderr
}

/// Off loopback without tokens and TLS, the binary refuses to start and
/// says which flag allows it.
#[test]
fn serve_refuses_to_listen_off_loopback_unprotected() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = refused(dir.path(), &["--listen", "0.0.0.0:0"]);
    assert!(
        stderr.contains("--insecure") && stderr.contains("0.0.0.0"),
        "the refusal names the address and the flag:\n{stderr}"
    );
}

/// A cache policy that does not exist is refused before anything starts,
/// naming the flag or key and the policies there are.
#[test]
fn serve_names_an_unknown_cache_policy() {
    let dir = tempfile::tempdir().unwrap();
    for (tier, policies) in [("device", ["lru", "loop"]), ("host", ["lru", "frequency"])] {
        let config = dir.path().join(format!("{tier}.toml"));
        std::fs::write(&config, format!("[tiers]\n{tier}_policy = \"fifo\"\n")).unwrap();
        let flag = format!("--{tier}-policy");
        let key = format!("{tier}_policy");
        for (args, names) in [
            ([flag.as_str(), "fifo"], flag.as_str()),
            (["--config", config.to_str().unwrap()], key.as_str()),
        ] {
            let stderr = refused(dir.path(), &args);
            assert!(
                stderr.contains(names) && policies.iter().all(|p| stderr.contains(p)),
                "the refusal names {names} and the policies:\n{stderr}"
            );
        }
    }
}
