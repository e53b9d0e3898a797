//! A client of a kvtier cluster: it follows the membership in etcd, creates
//! each sequence on the node placement gives it, and sends every later call
//! to the node that owns the sequence.
//!
//! Routing costs a map lookup per call: the owner of a sequence is learnt
//! once (from its create, or by asking the node placement names, which
//! answers with the owner when it is not), then calls go straight to the
//! owner's connection. A call refused because the sequence is elsewhere
//! (FAILED_PRECONDITION with the owner in its metadata) or because the
//! owner's connection failed is routed afresh and retried once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvtier_cluster::{EtcdConfig, NodeRecord, View};
use kvtier_core::placement::PlacementKey;
use tokio::sync::watch;
use tonic::Code;

use crate::client::{Client, ClientError, Connect, Result};

mod group;
use crate::pb;

/// A client of every node of a cluster, for one tenant.
#[derive(Debug, Clone)]
pub struct Cluster {
    view: watch::Receiver<Arc<View>>,
    options: Connect,
    tenant: String,
    /// One connection per node address.
    clients: Arc<Mutex<HashMap<String, Client>>>,
    /// What this client knows of each sequence it has routed.
    owners: Arc<Mutex<HashMap<String, Route>>>,
}

/// A sequence as this client knows it: the creation it created or first
/// found (calls are meant for that one: nodes refuse them once the id is
/// created again), and its owner's address while known.
#[derive(Debug, Clone)]
struct Route {
    addr: Option<String>,
    incarnation: u64,
}

/// Where a sequence went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// The node's id.
    pub node_id: String,
    /// Its gRPC address (`http://host:port` or `https://…`).
    pub addr: String,
}

impl Cluster {
    /// Follows the cluster in etcd; `options` reach its nodes (token, TLS).
    pub async fn connect(etcd: &EtcdConfig, options: Connect) -> Result<Self> {
        let view = kvtier_cluster::follow(etcd)
            .await
            .map_err(|e| ClientError::Cluster(format!("etcd at {}: {e}", etcd.endpoints.join(","))))?;
        Ok(Self {
            view,
            options,
            tenant: String::new(),
            clients: Arc::default(),
            owners: Arc::default(),
        })
    }

    /// Uses `tenant` for every later call.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = tenant.into();
        self.owners = Arc::default();
        self
    }

    /// The members as last seen.
    pub fn view(&self) -> Arc<View> {
        Arc::clone(&self.view.borrow())
    }

    /// Waits until the view shows `n` serving members (for tools and tests
    /// starting a cluster), at most `limit`.
    pub async fn wait_for_serving(&self, n: usize, limit: Duration) -> Result<()> {
        let mut view = self.view.clone();
        let serving = |v: &Arc<View>| {
            v.members()
                .filter(|m| m.state == kvtier_cluster::NodeState::Serving)
                .count()
                >= n
        };
        tokio::time::timeout(limit, view.wait_for(serving))
            .await
            .map_err(|_| ClientError::Cluster(format!("fewer than {n} nodes serving after {limit:?}")))?
            .map_err(|_| ClientError::Cluster("the membership watch ended".into()))?;
        Ok(())
    }

    fn client(&self, addr: &str) -> Result<Client> {
        let mut clients = self.clients.lock().expect("clients lock");
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone().with_tenant(self.tenant.clone()));
        }
        let client = Client::connect_lazy_with(addr.to_owned(), self.options.clone())?;
        clients.insert(addr.to_owned(), client.clone());
        Ok(client.with_tenant(self.tenant.clone()))
    }

    /// The tenant as servers name it (an empty one is the default tenant),
    /// which placement hashes.
    fn placement_tenant(&self) -> &str {
        if self.tenant.is_empty() {
            kvtier_core::TenantId::DEFAULT
        } else {
            &self.tenant
        }
    }

    fn owner_by_placement(&self, key: PlacementKey<'_>) -> Result<NodeRecord> {
        self.view()
            .owner(key)
            .cloned()
            .ok_or_else(|| ClientError::Cluster("no node is serving".into()))
    }

    /// Creates a sequence on the node placement gives it (with a hash
    /// chain: the node of its first page's hash, where a shared prompt's
    /// pages are). Retried once at the owner a node names.
    pub async fn create_sequence(
        &self,
        sequence_id: &str,
        layout: pb::Layout,
        prefix_hashes: Vec<Bytes>,
    ) -> Result<(Placed, pb::CreateSequenceResponse)> {
        let owner = self.owner_by_placement(PlacementKey::of(self.placement_tenant(), sequence_id, &prefix_hashes))?;
        self.create_at(owner, sequence_id, layout, prefix_hashes, None).await
    }

    /// Creates `sequence_id` on `owner` (as a shard of `group`, if given),
    /// once more where a node's refusal says its view places it, and
    /// remembers where it went.
    async fn create_at(
        &self,
        owner: NodeRecord,
        sequence_id: &str,
        layout: pb::Layout,
        prefix_hashes: Vec<Bytes>,
        group: Option<pb::PlacementGroup>,
    ) -> Result<(Placed, pb::CreateSequenceResponse)> {
        let create = |addr: String| {
            let (layout, hashes, group) = (layout.clone(), prefix_hashes.clone(), group.clone());
            async move {
                let mut client = self.client(&addr)?;
                client.create_in_group(sequence_id, layout, hashes, group).await
            }
        };
        let (placed, created) = match create(owner.addr.clone()).await {
            Ok(created) => (
                Placed {
                    node_id: owner.node_id,
                    addr: owner.addr,
                },
                created,
            ),
            // The node's view differs from this client's: once, where it says.
            Err(e) => match redirect(&e) {
                Some((node_id, addr)) => (
                    Placed {
                        node_id,
                        addr: addr.clone(),
                    },
                    create(addr).await?,
                ),
                None => return Err(e),
            },
        };
        self.remember(sequence_id, &placed.addr, created.incarnation);
        Ok((placed, created))
    }

    /// Where a prompt's pages are and how many of its leading pages are
    /// stored anywhere in the cluster, so a worker recomputes only the
    /// rest. The node placement gives its first hash is asked first (where
    /// a create with the chain goes and attaches them); unless it holds the
    /// whole chain, every other serving node is asked too (a node that
    /// joined since took the hash over, and the pages stay where they were
    /// until a rebalance moves them). The node holding the most leading
    /// pages answers; placement's node when none holds more.
    pub async fn lookup(&self, layout: pb::Layout, prefix_hashes: Vec<Bytes>) -> Result<(Placed, u64)> {
        let view = self.view();
        let owner = view
            .owner(PlacementKey::of(self.placement_tenant(), "", &prefix_hashes))
            .cloned()
            .ok_or_else(|| ClientError::Cluster("no node is serving".into()))?;
        let ask = |addr: String| {
            let (layout, hashes) = (layout.clone(), prefix_hashes.clone());
            async move { self.client(&addr)?.lookup_prefix(layout, hashes).await }
        };
        let mut best = (owner.clone(), ask(owner.addr.clone()).await?);
        if best.1 < prefix_hashes.len() as u64 {
            let mut asked = tokio::task::JoinSet::new();
            for node in view.members() {
                if node.state != kvtier_cluster::NodeState::Serving || node.node_id == owner.node_id {
                    continue;
                }
                let (node, cluster) = (node.clone(), self.clone());
                let (layout, hashes) = (layout.clone(), prefix_hashes.clone());
                asked.spawn(async move {
                    let pages = cluster.client(&node.addr)?.lookup_prefix(layout, hashes).await;
                    Ok::<_, ClientError>((node, pages?))
                });
            }
            while let Some(answer) = asked.join_next().await {
                // A node that cannot answer holds nothing this lookup can
                // use. Placement's node wins ties, then the lowest id, so
                // that every client answers alike.
                let Ok(Ok((node, pages))) = answer else { continue };
                let tie = pages == best.1 && best.0.node_id != owner.node_id && node.node_id < best.0.node_id;
                if pages > best.1 || tie {
                    best = (node, pages);
                }
            }
        }
        Ok((
            Placed {
                node_id: best.0.node_id,
                addr: best.0.addr,
            },
            best.1,
        ))
    }

    fn remember(&self, sequence_id: &str, addr: &str, incarnation: u64) {
        let route = Route {
            addr: Some(addr.to_owned()),
            incarnation,
        };
        self.owners
            .lock()
            .expect("owners lock")
            .insert(sequence_id.to_owned(), route);
    }

    /// Forgets where the sequence is, not which creation it is.
    fn unroute(&self, sequence_id: &str) {
        if let Some(route) = self.owners.lock().expect("owners lock").get_mut(sequence_id) {
            route.addr = None;
        }
    }

    /// Forgets the sequence (dropped).
    fn forget(&self, sequence_id: &str) {
        self.owners.lock().expect("owners lock").remove(sequence_id);
    }

    /// A client of the node that owns `sequence_id`, for the creation this
    /// client created or first found: the node its create went to, else
    /// found by asking the node placement names (which names the owner
    /// when it is not).
    pub async fn sequence(&self, sequence_id: &str) -> Result<Client> {
        let known = self.owners.lock().expect("owners lock").get(sequence_id).cloned();
        if let Some(Route {
            addr: Some(addr),
            incarnation,
        }) = &known
        {
            return Ok(self.client(addr)?.with_incarnation(*incarnation));
        }
        let known = known.map(|r| r.incarnation);
        // With no node serving (all draining, say), any member still
        // answers where the sequence is.
        let owner = match self.owner_by_placement(PlacementKey::Sequence {
            tenant: self.placement_tenant(),
            sequence_id,
        }) {
            Ok(owner) => owner,
            Err(e) => self.view().members().next().cloned().ok_or(e)?,
        };
        // Asked for the known creation, a node refuses a later one.
        let probe = |addr: String| async move {
            let mut client = self.client(&addr)?.with_incarnation(known.unwrap_or(0));
            let info = client.get_sequence(sequence_id).await?;
            Ok::<_, ClientError>((addr, info.incarnation))
        };
        let (addr, incarnation) = match probe(owner.addr).await {
            Ok(found) => found,
            Err(e) => match redirect(&e) {
                Some((_, addr)) => probe(addr).await?,
                None => return Err(e),
            },
        };
        let incarnation = known.unwrap_or(incarnation);
        self.remember(sequence_id, &addr, incarnation);
        Ok(self.client(&addr)?.with_incarnation(incarnation))
    }

    /// Runs `call` with the owner's client; a call refused because the
    /// sequence moved, or whose connection failed, is routed afresh and
    /// run once more (still for the same creation of the sequence).
    pub async fn call<T, F, Fut>(&self, sequence_id: &str, call: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let client = self.sequence(sequence_id).await?;
        match call(client).await {
            Err(e) if redirect(&e).is_some() || unreachable_node(&e) => {
                self.unroute(sequence_id);
                let known = self.owners.lock().expect("owners lock").get(sequence_id).cloned();
                if let (Some((_, addr)), Some(route)) = (redirect(&e), known) {
                    self.remember(sequence_id, &addr, route.incarnation);
                }
                call(self.sequence(sequence_id).await?).await
            }
            other => other,
        }
    }

    /// Drops a sequence on its owner.
    pub async fn drop_sequence(&self, sequence_id: &str) -> Result<()> {
        self.call(sequence_id, |mut c| async move { c.drop_sequence(sequence_id).await })
            .await?;
        self.forget(sequence_id);
        Ok(())
    }
}

/// The owner a FAILED_PRECONDITION names, if the error is one.
fn redirect(e: &ClientError) -> Option<(String, String)> {
    let ClientError::Status(status) = e else { return None };
    if status.code() != Code::FailedPrecondition {
        return None;
    }
    crate::client::refusal_owner(status)
}

/// A failed connection (the node is gone, or came back at another
/// address) or a node that cannot serve now: worth one fresh route.
fn unreachable_node(e: &ClientError) -> bool {
    match e {
        ClientError::Transport(_) => true,
        // A connection that broke mid-call is UNAVAILABLE too (`call_status`).
        ClientError::Status(s) => s.code() == Code::Unavailable,
        _ => false,
    }
}
