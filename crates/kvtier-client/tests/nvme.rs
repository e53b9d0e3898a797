//! The NVMe tier under a real server, with both I/O engines: pages migrate
//! to NVMe under host pressure and come back bit-exact, explicit moves work
//! across all three tiers, and bytes corrupted on disk are never served.

mod common;

use std::os::unix::fs::FileExt;

use common::{LaneData, TestServer, random_kv};
use kvtier_client::pb::set_page_state_request::Action;
use kvtier_client::{Client, ClientError, actions, pb};
use kvtier_store::{EngineChoice, NvmeConfig, StoreConfig};
use tonic::Code;

const DTYPE: pb::DType = pb::DType::DtypeF16;
const HEAD_DIM: usize = 64;
const PAGE: u32 = 16;
const PAGE_BYTES: u64 = 4096;

fn engines() -> Vec<EngineChoice> {
    let mut e = vec![EngineChoice::Psync];
    match kvtier_store::uring_available() {
        Ok(()) => e.push(EngineChoice::Uring),
        Err(reason) => println!("io_uring engine skipped: {reason}"),
    }
    e
}

struct Setup {
    server: TestServer,
    dir: tempfile::TempDir,
}

async fn start(engine: EngineChoice, host_pages: u64, nvme_pages: u64, promote_on_read: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(StoreConfig {
        device_bytes: 0,
        host_bytes: host_pages * PAGE_BYTES,
        cache_writes_on_device: false,
        nvme: Some(NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: nvme_pages * PAGE_BYTES,
            engine,
            queue_depth: 8,
            direct: true,
        }),
        promote_on_read,
        ..StoreConfig::default()
    })
    .await;
    Setup { server, dir }
}

fn layout() -> pb::Layout {
    kvtier_client::layout(1, 1, 1, HEAD_DIM as u32, DTYPE, PAGE)
}

async fn fill(client: &mut Client, seq: &str, pages: u32, data: &mut LaneData, seed: u64) -> Result<(), ClientError> {
    let mut scratch = data.clone();
    let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut scratch], (pages * PAGE) as usize, seed);
    let first = (data.keys.len() / (HEAD_DIM * 2) / PAGE as usize) as u32;
    client.put_pages(seq, 0, 0..1, first, pages * PAGE, kv).await?;
    *data = scratch;
    Ok(())
}

async fn check_all(client: &mut Client, seq: &str, data: &LaneData) -> Vec<pb::Page> {
    let pages = client.fetch_pages(seq, 0, 0..1, vec![]).await.unwrap();
    for p in &pages {
        assert!(
            p.kv[..] == data.page(p.page as usize, PAGE as usize, HEAD_DIM * 2)[..],
            "page {} differs",
            p.page
        );
    }
    pages
}

fn tier_used(stats: &pb::Stats, tier: pb::Tier) -> u64 {
    stats
        .tiers
        .iter()
        .find(|t| t.tier() == tier)
        .map_or(0, |t| t.used_bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_pressure_migrates_to_nvme_and_nothing_is_lost() {
    for engine in engines() {
        let setup = start(engine, 8, 64, false).await;
        let mut client = setup.server.client().await;
        client.create_sequence("s", layout(), vec![]).await.unwrap();
        let mut data = LaneData::default();
        // 40 pages into 8 pages of host: the rest must go to NVMe.
        for i in 0..10 {
            fill(&mut client, "s", 4, &mut data, i).await.unwrap();
        }
        let stats = client.stats().await.unwrap();
        assert!(tier_used(&stats, pb::Tier::Host) <= 8 * PAGE_BYTES);
        assert!(
            tier_used(&stats, pb::Tier::Nvme) >= 32 * PAGE_BYTES,
            "{engine:?}: {:?}",
            stats.tiers
        );
        let backend = stats
            .tiers
            .iter()
            .find(|t| t.tier() == pb::Tier::Nvme)
            .unwrap()
            .backend
            .clone();
        assert_eq!(
            backend,
            if engine == EngineChoice::Uring {
                "uring"
            } else {
                "psync"
            }
        );
        let pages = check_all(&mut client, "s", &data).await;
        let on_nvme = pages
            .iter()
            .filter(|p| p.state() == pb::PageState::Cold && p.cold_tier() == pb::Tier::Nvme)
            .count();
        assert!(on_nvme >= 32, "{engine:?}: {on_nvme} pages on nvme");
        // Both full: refused whole, nothing dropped.
        for i in 0..10 {
            if let Err(e) = fill(&mut client, "s", 4, &mut data, 100 + i).await {
                let ClientError::Status(s) = e else { panic!("{e}") };
                assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message());
                break;
            }
        }
        assert!(tier_used(&client.stats().await.unwrap(), pb::Tier::Nvme) <= 64 * PAGE_BYTES);
        check_all(&mut client, "s", &data).await;
        assert_eq!(client.get_sequence("s").await.unwrap().pages.unwrap().gone, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_moves_cross_all_three_tiers_bit_exact() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(StoreConfig {
            device_bytes: 8 * PAGE_BYTES,
            host_bytes: 64 * PAGE_BYTES,
            nvme: Some(NvmeConfig {
                path: dir.path().join("nvme.data"),
                capacity: 64 * PAGE_BYTES,
                engine,
                queue_depth: 4,
                direct: true,
            }),
            promote_on_read: false,
            ..StoreConfig::default()
        })
        .await;
        let mut client = server.client().await;
        client.create_sequence("s", layout(), vec![]).await.unwrap();
        let mut data = LaneData::default();
        fill(&mut client, "s", 6, &mut data, 7).await.unwrap();
        let tier = |t: pb::Tier| Action::Migrate(pb::Migrate { tier: t as i32 });
        let offload_nvme = Action::Offload(pb::Offload {
            tier: pb::Tier::Nvme as i32,
        });
        // Pages 0..6 start hot. hot → cold(nvme) for 0..2; hot → cold(host)
        // for 2..6, then cold(host) → cold(nvme) for 2..4.
        client
            .set_page_state("s", 0..1, 0..1, 0..2, offload_nvme)
            .await
            .unwrap();
        client
            .set_page_state("s", 0..1, 0..1, 2..6, actions::offload_to_host())
            .await
            .unwrap();
        client
            .set_page_state("s", 0..1, 0..1, 2..4, tier(pb::Tier::Nvme))
            .await
            .unwrap();
        let states: Vec<_> = check_all(&mut client, "s", &data)
            .await
            .iter()
            .map(|p| (p.state(), p.cold_tier()))
            .collect();
        let nvme = (pb::PageState::Cold, pb::Tier::Nvme);
        let host = (pb::PageState::Cold, pb::Tier::Host);
        assert_eq!(states, [nvme, nvme, nvme, nvme, host, host], "{engine:?}");
        // cold(nvme) → cold(host), and cold(nvme) → hot.
        client
            .set_page_state("s", 0..1, 0..1, 0..1, tier(pb::Tier::Host))
            .await
            .unwrap();
        client
            .set_page_state("s", 0..1, 0..1, 1..2, actions::swap_in())
            .await
            .unwrap();
        let states: Vec<_> = check_all(&mut client, "s", &data)
            .await
            .iter()
            .map(|p| (p.state(), p.cold_tier()))
            .collect();
        assert_eq!(states[..3], [host, (pb::PageState::Hot, pb::Tier::Unspecified), nvme]);
        // Illegal: migrating a cold(nvme) page to nvme.
        let err = client
            .set_page_state("s", 0..1, 0..1, 2..3, tier(pb::Tier::Nvme))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ClientError::Status(ref s) if s.code() == Code::FailedPrecondition),
            "{err}"
        );
        // Appending into a partial page that lives on NVMe brings it back first.
        let mut tail = LaneData::default();
        client.create_sequence("t", layout(), vec![]).await.unwrap();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut tail], 5, 9);
        client.put_pages("t", 0, 0..1, 0, 5, kv).await.unwrap();
        let offload = Action::Offload(pb::Offload {
            tier: pb::Tier::Nvme as i32,
        });
        client.set_page_state("t", 0..1, 0..1, 0..1, offload).await.unwrap();
        let kv = random_kv(DTYPE, HEAD_DIM, &mut [&mut tail], 20, 10);
        client.append_tokens("t", 0, 0..1, 20, kv, Some(5)).await.unwrap();
        check_all(&mut client, "t", &tail).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_nvme_bytes_are_never_served() {
    for engine in engines() {
        let setup = start(engine, 64, 64, false).await;
        let mut client = setup.server.client().await;
        client.create_sequence("s", layout(), vec![]).await.unwrap();
        let mut data = LaneData::default();
        fill(&mut client, "s", 8, &mut data, 3).await.unwrap();
        let migrate = Action::Migrate(pb::Migrate {
            tier: pb::Tier::Nvme as i32,
        });
        client.set_page_state("s", 0..1, 0..1, 0..8, migrate).await.unwrap();
        // Flip one byte in every page-sized block of the file's first half.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(setup.dir.path().join("nvme.data"))
            .unwrap();
        let mut flipped = 0;
        for block in 0..4u64 {
            let at = block * PAGE_BYTES + 1000;
            let mut byte = [0u8; 1];
            file.read_exact_at(&mut byte, at).unwrap();
            file.write_all_at(&[byte[0] ^ 0x40], at).unwrap();
            flipped += 1;
        }
        file.sync_all().unwrap();
        drop(file);
        let pages = client.fetch_pages("s", 0, 0..1, vec![]).await.unwrap();
        let mut gone = 0;
        for p in &pages {
            match p.state() {
                pb::PageState::Gone => {
                    assert_eq!(p.gone_reason(), pb::Reason::Integrity);
                    assert!(p.kv.is_empty());
                    gone += 1;
                }
                _ => assert!(
                    p.kv[..] == data.page(p.page as usize, PAGE as usize, HEAD_DIM * 2)[..],
                    "wrong bytes served"
                ),
            }
        }
        assert_eq!(gone, flipped, "{engine:?}: every corrupted page reported, no other");
        let info = client.get_sequence("s").await.unwrap();
        assert_eq!(
            info.gone,
            [pb::ReasonCount {
                reason: pb::Reason::Integrity as i32,
                pages: flipped
            }]
        );
        let stats = client.stats().await.unwrap();
        let integrity: u64 = stats
            .transitions
            .iter()
            .filter(|t| t.reason() == pb::Reason::Integrity)
            .map(|t| t.count)
            .sum();
        assert_eq!(integrity, flipped);
        // Selection still scores them (digests stay) and counts them gone.
        let req = kvtier_client::SelectRequest::new(0, 0..1, vec![1.0; HEAD_DIM], 8);
        let sel = client.select_pages("s", &req).await.unwrap();
        assert_eq!(sel.heads[0].selected_but_gone, flipped as u32);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_swaps_in_from_every_tier_and_leases_over_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(StoreConfig {
        device_bytes: 32 * PAGE_BYTES,
        host_bytes: 64 * PAGE_BYTES,
        cache_writes_on_device: false,
        nvme: Some(NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 64 * PAGE_BYTES,
            engine: EngineChoice::Auto,
            queue_depth: 8,
            direct: true,
        }),
        promote_on_read: false,
        ..StoreConfig::default()
    })
    .await;
    let mut client = server.client().await;
    client.create_sequence("s", layout(), vec![]).await.unwrap();
    let mut data = LaneData::default();
    fill(&mut client, "s", 9, &mut data, 5).await.unwrap();
    let list = |pages: Vec<u32>, action: Action| pb::SetPageStateRequest {
        sequence_id: "s".into(),
        layer_count: 1,
        kv_head_count: 1,
        pages,
        action: Some(action),
        ..Default::default()
    };
    client
        .raw()
        .set_page_state(list(vec![0, 1, 2], actions::swap_in()))
        .await
        .unwrap();
    let to_nvme = Action::Migrate(pb::Migrate {
        tier: pb::Tier::Nvme as i32,
    });
    client.raw().set_page_state(list(vec![6, 7, 8], to_nvme)).await.unwrap();
    let req = kvtier_client::SelectRequest {
        swap_in: true,
        include_data: true,
        lease_ms: 60_000,
        ..kvtier_client::SelectRequest::new(0, 0..1, vec![0.5; HEAD_DIM], 9)
    };
    let sel = client.select_pages("s", &req).await.unwrap();
    let s = &sel.swap;
    assert_eq!((s.already_hot, s.from_host, s.from_nvme, s.not_hot), (3, 3, 3, 0));
    assert!(
        sel.heads[0]
            .pages
            .iter()
            .all(|p| p.state() == pb::PageState::Hot && p.miss() == pb::Miss::None)
    );
    for p in &sel.pages {
        assert!(
            p.kv[..] == data.page(p.page as usize, PAGE as usize, HEAD_DIM * 2)[..],
            "page {}",
            p.page
        );
    }
    let (lease, expires_in) = sel.lease.expect("lease granted");
    assert!(expires_in > 50_000);
    let err = client
        .set_page_state("s", 0..1, 0..1, 0..1, actions::offload_to_host())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("leased"), "{err}");
    client.release_lease(lease).await.unwrap();
    let err = client.release_lease(lease).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Status(ref s) if s.code() == Code::NotFound),
        "{err}"
    );
    client
        .set_page_state("s", 0..1, 0..1, 0..9, actions::offload_to_host())
        .await
        .unwrap();
    // Prefetch only schedules; it refuses the fields that would do more.
    let queued = client
        .prefetch("s", &kvtier_client::SelectRequest::new(0, 0..1, vec![0.5; HEAD_DIM], 3))
        .await
        .unwrap();
    assert_eq!(queued, 3);
    let bad = kvtier_client::SelectRequest {
        swap_in: true,
        ..kvtier_client::SelectRequest::new(0, 0..1, vec![0.5; HEAD_DIM], 3)
    };
    let err = client.prefetch("s", &bad).await.unwrap_err();
    assert!(err.to_string().contains("swap_in"), "{err}");
    let appending = kvtier_client::SelectRequest {
        append: Some(kvtier_client::pb::AppendAfterSelection {
            num_tokens: 1,
            kv: vec![0; 2 * HEAD_DIM * 4].into(),
            position: None,
            persist: false,
        }),
        ..kvtier_client::SelectRequest::new(0, 0..1, vec![0.5; HEAD_DIM], 3)
    };
    let err = client.prefetch("s", &appending).await.unwrap_err();
    assert!(err.to_string().contains("append: must be unset for Prefetch"), "{err}");
    let stats = client.stats().await.unwrap();
    assert_eq!((stats.swapped_from_host, stats.swapped_from_nvme), (3, 3));
}
