//! `kvtier bench fetch`: replays the page lists a decode run selected (its
//! `--trace`) as page fetches — kvtier's `FetchPages` and, with `--redis`,
//! the do-it-yourself store a user would build otherwise: one Redis value
//! per page, fetched with MGET — same pages, same sizes, same order, in one
//! run. Selection is kvtier's in both, so this compares the serving paths.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use clap::Args;
use kvtier_client::{Client, pb};
use kvtier_server::{BoundServer, ServerConfig};
use kvtier_store::{Store, StoreConfig};

use crate::shape::Shape;
use serde::Serialize;

use crate::trace::Trace;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// One fetch of the replay: a read of the trace, its pages per KV head.
#[derive(Debug, Clone)]
struct FetchEntry {
    sequence: usize,
    layer: u32,
    pages: Vec<Vec<u32>>,
}

/// What the replay loads before fetching: every page below the largest
/// one read, in every lane of every sequence.
#[derive(Debug, Clone, Copy)]
struct Loaded {
    sequences: usize,
    pages_per_lane: u32,
}

/// The trace's reads as fetches; its sequences must share one shape.
fn fetches(trace: &Trace) -> anyhow::Result<(Loaded, Shape, Vec<FetchEntry>)> {
    let shape = trace.shapes[0].clone();
    ensure!(
        trace.shapes.iter().all(|s| s.layout() == shape.layout()),
        "the trace's sequences have different shapes; bench fetch replays one"
    );
    let entries: Vec<FetchEntry> = trace
        .events
        .iter()
        .filter(|e| !e.write)
        .map(|e| {
            let mut pages = vec![Vec::new(); shape.kv_heads as usize];
            for h in &e.access.heads {
                pages[h.head as usize].extend(&h.pages);
            }
            FetchEntry {
                sequence: e.sequence,
                layer: e.access.layer,
                pages,
            }
        })
        .collect();
    let most = entries.iter().flat_map(|e| e.pages.iter().flatten()).max();
    let loaded = Loaded {
        sequences: trace.shapes.len(),
        pages_per_lane: most.map_or(0, |&p| p + 1),
    };
    Ok((loaded, shape, entries))
}

#[derive(Debug, Args)]
pub(crate) struct FetchBenchArgs {
    /// An access trace: written by `kvtier bench decode --trace`, or
    /// recorded by a server (`kvtier serve --access-trace`); its reads are
    /// replayed as fetches.
    #[arg(long)]
    trace: PathBuf,
    /// A running kvtier server (http://host:port) instead of an in-process one.
    #[arg(long)]
    addr: Option<String>,
    /// Also replay against this Redis server (host:port).
    #[arg(long)]
    redis: Option<String>,
    /// With --addr: the server's shm socket, to replay through the shm data
    /// plane too (the in-process server always offers one).
    #[arg(long, value_name = "PATH")]
    shm_socket: Option<std::path::PathBuf>,
    /// A running echo server (`kvtier bench echo`, host:port) for the
    /// floor, instead of one this starts: a server's latency depends on
    /// the CPUs it runs on, and one started here runs where this does
    /// (a wake-up on the client's own CPU costs less than one across), so
    /// a fair floor runs where the kvtier server does.
    #[arg(long, value_name = "ADDR")]
    echo: Option<std::net::SocketAddr>,
    /// The local calls run twice: sleeping on each reply (`set_spin(0)`),
    /// and polling for it for up to this long first while replies come
    /// within it (`ShmRegion::set_spin`; the client's default).
    #[arg(long, value_name = "MICROSECONDS", default_value_t = kvtier_client::DEFAULT_SPIN.as_micros() as u64)]
    poll_us: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Side {
    fetches: usize,
    bytes: u64,
    mean_us: f64,
    p50_us: u64,
    p99_us: u64,
    p999_us: u64,
    max_us: u64,
    mb_per_s: f64,
    /// The smallest round trip (kvtier: a FetchPages of no pages; Redis:
    /// PING), the fixed cost inside every fetch.
    floor_p50_us: u64,
    floor_p99_us: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    trace: String,
    page_bytes: usize,
    fetches: usize,
    kvtier: Side,
    /// The same fetches through the shm data plane, called over gRPC.
    kvtier_shm: Option<Side>,
    /// The same again, called over the region's own socket
    /// (`kvtier.v1.LocalCall`): no HTTP/2; sleeping on each reply.
    kvtier_local: Option<Side>,
    /// The local calls again, each polling for its reply for up to
    /// `poll_us` (while replies come within it) before sleeping on it.
    kvtier_local_polling: Option<Side>,
    poll_us: u64,
    redis: Option<Side>,
    /// Redis p50 / kvtier p50 and the same at p99 (above 1: kvtier is faster).
    ratio_p50: Option<f64>,
    ratio_p99: Option<f64>,
    /// Redis / kvtier over shm, p50 and p99.
    shm_ratio_p50: Option<f64>,
    shm_ratio_p99: Option<f64>,
    /// Redis / kvtier over shm called over its socket, p50 and p99.
    local_ratio_p50: Option<f64>,
    local_ratio_p99: Option<f64>,
    /// Redis / kvtier's polling local calls, p50 and p99.
    polling_ratio_p50: Option<f64>,
    polling_ratio_p99: Option<f64>,
    /// A bare tonic unary echo, each call alternating with kvtier's empty
    /// call: the floor any gRPC call pays here.
    echo_p50_us: u64,
    echo_p99_us: u64,
    /// kvtier's empty call p50 / the echo's p50 (1 is the floor).
    empty_over_echo_p50: f64,
    /// The echo again, answering each fetch with as many bytes as kvtier
    /// served it inline (its empty call the floor): what any tonic call
    /// answering those bytes pays here.
    echo_sized: Side,
    /// kvtier inline p50 / the sized echo's p50 (1 is the floor).
    inline_over_echo_sized_p50: f64,
    /// Redis p50 / the sized echo's p50: the most any tonic service could
    /// show against Redis on these fetches here.
    echo_sized_ratio_p50: Option<f64>,
}

fn side(latencies: &[u64], floor: &[u64], bytes: u64, seconds: f64) -> Side {
    let h = super::decode::histogram(latencies.iter().copied());
    let floor = super::decode::histogram(floor.iter().copied());
    Side {
        fetches: latencies.len(),
        bytes,
        mean_us: h.mean(),
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        max_us: h.max(),
        mb_per_s: bytes as f64 / seconds / 1e6,
        floor_p50_us: floor.value_at_quantile(0.5),
        floor_p99_us: floor.value_at_quantile(0.99),
    }
}

pub(crate) fn run(args: FetchBenchArgs) -> anyhow::Result<()> {
    let (header, shape, entries) = fetches(&Trace::read(&args.trace)?)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // The floor runs where the kvtier server does: in this process, or in
    // a process of its own.
    let echo_server = match (args.echo, &args.addr) {
        (Some(addr), _) => super::echo::running_at(addr),
        (None, Some(_)) => super::echo::start_process()?,
        (None, None) => super::echo::start()?,
    };
    let report = runtime.block_on(async {
        let target = (args.addr.as_deref(), args.shm_socket.as_deref());
        let poll = std::time::Duration::from_micros(args.poll_us);
        let (kvtier, shm, echo, echo_sized) =
            replay_kvtier(target, &header, &shape, &entries, &echo_server, poll).await?;
        let (kvtier_shm, kvtier_local, kvtier_local_polling) = match shm {
            Some((shm, local, polling)) => (Some(shm), Some(local), Some(polling)),
            None => (None, None, None),
        };
        let echo_sized = side(&echo_sized.0, &echo, echo_sized.1, echo_sized.2);
        let echo = super::decode::histogram(echo.into_iter());
        let redis = match &args.redis {
            Some(addr) => Some(replay_redis(addr, &header, &shape, &entries).await?),
            None => None,
        };
        if let Some(r) = &redis {
            ensure!(
                r.bytes == kvtier.bytes,
                "kvtier served {} bytes, Redis {}",
                kvtier.bytes,
                r.bytes
            );
        }
        let ratio = |f: fn(&Side) -> u64, k: Option<&Side>| {
            redis.as_ref().zip(k).map(|(r, k)| f(r) as f64 / f(k).max(1) as f64)
        };
        anyhow::Ok(Report {
            trace: args.trace.display().to_string(),
            page_bytes: shape.page_bytes(),
            fetches: entries.len(),
            ratio_p50: ratio(|s| s.p50_us, Some(&kvtier)),
            ratio_p99: ratio(|s| s.p99_us, Some(&kvtier)),
            shm_ratio_p50: ratio(|s| s.p50_us, kvtier_shm.as_ref()),
            shm_ratio_p99: ratio(|s| s.p99_us, kvtier_shm.as_ref()),
            local_ratio_p50: ratio(|s| s.p50_us, kvtier_local.as_ref()),
            local_ratio_p99: ratio(|s| s.p99_us, kvtier_local.as_ref()),
            polling_ratio_p50: ratio(|s| s.p50_us, kvtier_local_polling.as_ref()),
            polling_ratio_p99: ratio(|s| s.p99_us, kvtier_local_polling.as_ref()),
            echo_p50_us: echo.value_at_quantile(0.5),
            echo_p99_us: echo.value_at_quantile(0.99),
            empty_over_echo_p50: kvtier.floor_p50_us as f64 / echo.value_at_quantile(0.5).max(1) as f64,
            inline_over_echo_sized_p50: kvtier.p50_us as f64 / echo_sized.p50_us.max(1) as f64,
            echo_sized_ratio_p50: ratio(|s| s.p50_us, Some(&echo_sized)),
            echo_sized,
            kvtier,
            kvtier_shm,
            kvtier_local,
            kvtier_local_polling,
            poll_us: args.poll_us,
            redis,
        })
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let line = |name: &str, s: &Side| {
            println!(
                "{name:>7}: {} fetches, {:.1} MB, mean {:.0} µs, p50 {} µs, p99 {} µs, p99.9 {} µs, max {} µs, {:.0} MB/s; empty call p50 {} µs p99 {} µs",
                s.fetches,
                s.bytes as f64 / 1e6,
                s.mean_us,
                s.p50_us,
                s.p99_us,
                s.p999_us,
                s.max_us,
                s.mb_per_s,
                s.floor_p50_us,
                s.floor_p99_us
            )
        };
        line("kvtier", &report.kvtier);
        if let Some(shm) = &report.kvtier_shm {
            line("shm", shm);
        }
        if let Some(local) = &report.kvtier_local {
            line("local", local);
        }
        if let Some(polling) = &report.kvtier_local_polling {
            line("polling", polling);
        }
        println!(
            "   echo: bare tonic unary p50 {} µs p99 {} µs; kvtier's empty call {:.2}× of it",
            report.echo_p50_us, report.echo_p99_us, report.empty_over_echo_p50
        );
        line("echo", &report.echo_sized);
        println!(
            "   echo answering each fetch's bytes: kvtier inline p50 {:.2}× of it",
            report.inline_over_echo_sized_p50
        );
        if let Some(r) = &report.redis {
            line("redis", r);
            println!(
                "redis/kvtier: p50 {:.2}×, p99 {:.2}×; redis/kvtier shm: p50 {:.2}×, p99 {:.2}×; over its socket: p50 {:.2}×, p99 {:.2}×; polling {} µs: p50 {:.2}×, p99 {:.2}×; redis/sized echo p50 {:.2}×",
                report.ratio_p50.unwrap_or(0.0),
                report.ratio_p99.unwrap_or(0.0),
                report.shm_ratio_p50.unwrap_or(0.0),
                report.shm_ratio_p99.unwrap_or(0.0),
                report.local_ratio_p50.unwrap_or(0.0),
                report.local_ratio_p99.unwrap_or(0.0),
                report.poll_us,
                report.polling_ratio_p50.unwrap_or(0.0),
                report.polling_ratio_p99.unwrap_or(0.0),
                report.echo_sized_ratio_p50.unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// How many empty round trips measure each side's fixed cost per call.
const FLOOR_CALLS: usize = 2000;

/// A kvtier server for the replay: the one at `addr`, or an in-process one
/// holding every page in host memory, on a runtime of its own as
/// `kvtier serve` would be (the replay's client runs on one thread).
async fn kvtier_client(addr: Option<&str>, h: &Loaded, shape: &Shape) -> anyhow::Result<(Client, Option<InProcess>)> {
    if let Some(addr) = addr {
        return Ok((Client::connect(addr.to_owned()).await?, None));
    }
    let dir = tempfile::tempdir()?;
    let lanes = h.sequences as u64 * u64::from(shape.layers * shape.kv_heads);
    let total = lanes * u64::from(h.pages_per_lane) * shape.page_bytes() as u64;
    let store = Store::new(StoreConfig {
        device_bytes: 0,
        host_bytes: total + total / 8 + (16 << 20),
        cache_writes_on_device: false,
        ..StoreConfig::default()
    })?;
    let server = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: None,
        shm_socket: Some(dir.path().join("shm.sock")),
        ..ServerConfig::default()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let served = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|runtime| {
                runtime.block_on(async {
                    let bound = BoundServer::bind(store, server).await?;
                    let _ = bound_tx.send(Ok(bound.grpc_addr()));
                    bound
                        .serve(async {
                            let _ = stopped.await;
                        })
                        .await?;
                    anyhow::Ok(())
                })
            });
        if let Err(e) = served {
            let _ = bound_tx.send(Err(e));
        }
    });
    let addr = tokio::task::spawn_blocking(move || bound_rx.recv())
        .await?
        .context("the in-process server ended")??;
    let client = Client::connect(format!("http://{addr}")).await?;
    Ok((client, Some(InProcess { stop, thread, dir })))
}

/// An in-process server, stopped and joined at the end of the replay.
#[derive(Debug)]
struct InProcess {
    stop: oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
    /// Holds its shm socket.
    dir: tempfile::TempDir,
}

/// Loads every page of the trace's sequences, then fetches each entry's
/// pages with one `FetchPages` (per-head lists), inline and, where the
/// server has an shm socket, through the shm data plane, called over gRPC
/// and over the region's socket (sleeping on each reply, then polling for
/// up to `poll` first). Also returns the echo floor's latencies, measured
/// alternately with kvtier's empty calls, and the echo answering each
/// fetch's bytes, right after the inline fetches.
async fn replay_kvtier(
    (addr, shm_socket): (Option<&str>, Option<&std::path::Path>),
    h: &Loaded,
    shape: &Shape,
    entries: &[FetchEntry],
    echo_server: &super::echo::EchoServerHandle,
    poll: std::time::Duration,
) -> anyhow::Result<(Side, Option<(Side, Side, Side)>, Vec<u64>, Measured)> {
    let (mut client, in_process) = kvtier_client(addr, h, shape).await?;
    let name = |s: usize| format!("fetch-{}-{s}", std::process::id());
    // Messages of at most ~16 MiB; the bytes do not matter, their size does.
    let per_page = shape.kv_heads as usize * shape.page_bytes();
    let chunk = ((16 << 20) / per_page).max(1) as u32;
    for s in 0..h.sequences {
        client.create_sequence(&name(s), shape.layout(), vec![]).await?;
        for layer in 0..shape.layers {
            let mut writes = Vec::new();
            for first in (0..h.pages_per_lane).step_by(chunk as usize) {
                let n = chunk.min(h.pages_per_lane - first);
                let kv = vec![0u8; n as usize * per_page].into();
                writes.push(client.page_write(&name(s), layer, 0..shape.kv_heads, first, n * shape.page_size, kv));
            }
            client.put_page_stream(writes).await?;
        }
    }
    let fetch = |sequence: usize, layer: u32, pages: &[Vec<u32>]| pb::FetchPagesRequest {
        sequence_id: name(sequence),
        layer,
        kv_head_count: shape.kv_heads,
        per_head_pages: pages.iter().map(|p| pb::PageList { pages: p.clone() }).collect(),
        max_chunk_bytes: 32 << 20,
        ..Default::default()
    };
    let mut floor = Vec::with_capacity(FLOOR_CALLS);
    let mut echo = Vec::with_capacity(FLOOR_CALLS);
    let mut echo_client = super::echo::client(echo_server).await?;
    let no_pages = vec![Vec::new(); shape.kv_heads as usize];
    for _ in 0..FLOOR_CALLS {
        let t = Instant::now();
        super::echo::call(&mut echo_client, 0).await?;
        echo.push(t.elapsed().as_micros() as u64);
        let req = fetch(0, 0, &no_pages);
        let t = Instant::now();
        client.fetch(req).await?;
        floor.push(t.elapsed().as_micros() as u64);
    }
    let request = |e: &FetchEntry| fetch(e.sequence, e.layer, &e.pages);
    let inline = replay(entries, request, async |req| Ok(served(&client.fetch(req).await?))).await?;
    let page_bytes = shape.page_bytes() as u64;
    let fetch_bytes = |e: &FetchEntry| e.pages.iter().map(|p| p.len() as u64).sum::<u64>() * page_bytes;
    let echo_sized = replay(entries, fetch_bytes, async |n| {
        super::echo::call(&mut echo_client, n).await
    })
    .await?;
    anyhow::ensure!(
        echo_sized.1 == inline.1,
        "the echo answered {} bytes, kvtier inline {}",
        echo_sized.1,
        inline.1
    );
    let socket = in_process
        .as_ref()
        .map(|p| p.dir.path().join("shm.sock"))
        .or_else(|| shm_socket.map(std::path::Path::to_path_buf));
    let shm = match socket {
        Some(socket) => {
            let most = entries
                .iter()
                .map(|e| e.pages.iter().map(Vec::len).sum::<usize>())
                .max();
            let mut region = client
                .register_shm(&socket, most.unwrap_or(1).max(1) * shape.page_bytes())
                .await?;
            let whole = region.whole();
            let named = |e: &FetchEntry| pb::FetchPagesRequest {
                shm: Some(whole),
                ..request(e)
            };
            let shm = replay(entries, named, async |req| Ok(served(&client.fetch(req).await?))).await?;
            anyhow::ensure!(shm.1 == inline.1, "shm served {} bytes, inline {}", shm.1, inline.1);
            let mut replay_local = async |spin| {
                region.set_spin(spin);
                let mut local_floor = Vec::with_capacity(FLOOR_CALLS);
                for _ in 0..FLOOR_CALLS {
                    let t = Instant::now();
                    client.fetch_local(&mut region, fetch(0, 0, &no_pages)).await?;
                    local_floor.push(t.elapsed().as_micros() as u64);
                }
                let (latencies, bytes, seconds) = replay(entries, request, async |req| {
                    Ok(served(&client.fetch_local(&mut region, req).await?))
                })
                .await?;
                anyhow::ensure!(
                    bytes == inline.1,
                    "local calls served {bytes} bytes, inline {}",
                    inline.1
                );
                anyhow::Ok(side(&latencies, &local_floor, bytes, seconds))
            };
            let sleeping = replay_local(std::time::Duration::ZERO).await?;
            let polling = replay_local(poll).await?;
            Some((shm, sleeping, polling))
        }
        None => None,
    };
    for s in 0..h.sequences {
        client.drop_sequence(&name(s)).await?;
    }
    if let Some(server) = in_process {
        let _ = server.stop.send(());
        drop(client);
        let _ = tokio::task::spawn_blocking(move || server.thread.join()).await;
    }
    let side = |(latencies, bytes, seconds): Measured| side(&latencies, &floor, bytes, seconds);
    Ok((
        side(inline),
        shm.map(|(shm, sleeping, polling)| (side(shm), sleeping, polling)),
        echo,
        echo_sized,
    ))
}

/// Latencies in µs, bytes served, seconds in all.
type Measured = (Vec<u64>, u64, f64);

/// Each entry's call (its `request`, made before the clock starts, then
/// `send`, which answers the bytes served), one at a time.
async fn replay<R>(
    entries: &[FetchEntry],
    request: impl Fn(&FetchEntry) -> R,
    mut send: impl AsyncFnMut(R) -> anyhow::Result<u64>,
) -> anyhow::Result<Measured> {
    let mut latencies = Vec::with_capacity(entries.len());
    let mut bytes = 0u64;
    let start = Instant::now();
    for e in entries {
        let req = request(e);
        let t = Instant::now();
        let served = send(req).await?;
        latencies.push(t.elapsed().as_micros() as u64);
        bytes += served;
    }
    Ok((latencies, bytes, start.elapsed().as_secs_f64()))
}

/// The bytes a fetch's pages served, inline or into a region.
fn served(pages: &[pb::Page]) -> u64 {
    pages.iter().map(|p| p.kv.len() as u64 + p.shm_bytes).sum()
}

/// A minimal RESP client: enough for pipelined SETs and MGET.
struct Redis {
    reader: BufReader<tokio::io::ReadHalf<TcpStream>>,
    writer: tokio::io::WriteHalf<TcpStream>,
}

impl Redis {
    async fn connect(addr: &str) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to Redis at {addr}"))?;
        stream.set_nodelay(true)?;
        let (r, w) = tokio::io::split(stream);
        Ok(Self {
            reader: BufReader::with_capacity(1 << 20, r),
            writer: w,
        })
    }

    fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
    }

    async fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        self.reader.read_line(&mut line).await?;
        ensure!(line.ends_with("\r\n"), "Redis closed the connection");
        Ok(line.trim_end().to_owned())
    }

    /// Reads one reply: a status or an integer (0), or an array of bulk
    /// strings (their total bytes).
    async fn reply(&mut self) -> anyhow::Result<u64> {
        let head = self.line().await?;
        match head.as_bytes().first() {
            Some(b'+' | b':') => Ok(0),
            Some(b'-') => bail!("Redis: {head}"),
            Some(b'*') => {
                let n: usize = head[1..].parse()?;
                let mut total = 0u64;
                for _ in 0..n {
                    let len: i64 = self.line().await?[1..].parse()?;
                    ensure!(len >= 0, "Redis: a page is missing");
                    let mut buf = vec![0u8; len as usize + 2];
                    self.reader.read_exact(&mut buf).await?;
                    total += len as u64;
                }
                Ok(total)
            }
            _ => bail!("Redis: unexpected reply {head:?}"),
        }
    }
}

fn redis_key(seq: usize, layer: u32, head: usize, page: u32) -> Vec<u8> {
    format!("kvtier-bench-{}:s{seq}:l{layer}:h{head}:p{page}", std::process::id()).into_bytes()
}

/// Runs `command` (SET with a value, or UNLINK) on every page of the trace's
/// sequences, one pipelined batch per (sequence, layer, KV head).
async fn every_page(redis: &mut Redis, h: &Loaded, shape: &Shape, command: &[&[u8]]) -> anyhow::Result<()> {
    for s in 0..h.sequences {
        for layer in 0..shape.layers {
            for head in 0..shape.kv_heads as usize {
                let mut batch = Vec::new();
                for page in 0..h.pages_per_lane {
                    let key = redis_key(s, layer, head, page);
                    let mut args = vec![command[0], &key];
                    args.extend_from_slice(&command[1..]);
                    Redis::command(&mut batch, &args);
                }
                redis.writer.write_all(&batch).await?;
                for _ in 0..h.pages_per_lane {
                    redis.reply().await?;
                }
            }
        }
    }
    Ok(())
}

/// Loads every page as one value, then fetches each entry's pages with one
/// MGET; deletes its keys at the end.
async fn replay_redis(addr: &str, h: &Loaded, shape: &Shape, entries: &[FetchEntry]) -> anyhow::Result<Side> {
    let mut redis = Redis::connect(addr).await?;
    let value = vec![0u8; shape.page_bytes()];
    every_page(&mut redis, h, shape, &[b"SET", &value]).await?;
    let mut floor = Vec::with_capacity(FLOOR_CALLS);
    let mut ping = Vec::new();
    Redis::command(&mut ping, &[b"PING"]);
    for _ in 0..FLOOR_CALLS {
        let t = Instant::now();
        redis.writer.write_all(&ping).await?;
        redis.reply().await?;
        floor.push(t.elapsed().as_micros() as u64);
    }
    let mut latencies = Vec::with_capacity(entries.len());
    let mut bytes = 0u64;
    let start = Instant::now();
    for e in entries {
        let keys: Vec<Vec<u8>> = e
            .pages
            .iter()
            .enumerate()
            .flat_map(|(head, pages)| pages.iter().map(move |&p| redis_key(e.sequence, e.layer, head, p)))
            .collect();
        let mut args: Vec<&[u8]> = vec![b"MGET"];
        args.extend(keys.iter().map(Vec::as_slice));
        let mut cmd = Vec::new();
        Redis::command(&mut cmd, &args);
        let t = Instant::now();
        redis.writer.write_all(&cmd).await?;
        bytes += redis.reply().await?;
        latencies.push(t.elapsed().as_micros() as u64);
    }
    let seconds = start.elapsed().as_secs_f64();
    every_page(&mut redis, h, shape, &[b"UNLINK"]).await?;
    Ok(side(&latencies, &floor, bytes, seconds))
}
