//! The request fields that errors name: one source for every error's field
//! path, written as protobuf field paths of the `kvtier.v1` request messages
//! that carry them (a oneof's name stands for whichever member is set). A
//! test in `kvtier-server` (`tests/wire_fields.rs`) checks each against the
//! proto's descriptor, so an error never names a field a client cannot find.

/// A field path and the request messages (in `kvtier.v1`) that have it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Protobuf field path, dotted for nested messages (`layout.head_dim`).
    pub path: &'static str,
    /// Names of the `kvtier.v1` request messages that carry the field.
    pub requests: &'static [&'static str],
}

impl Field {
    /// The path with an index into its (last, repeated) field: `pages[3]`.
    pub fn at(self, index: usize) -> String {
        format!("{}[{index}]", self.path)
    }
}

impl From<Field> for String {
    fn from(f: Field) -> Self {
        f.path.to_owned()
    }
}

const CREATE: &str = "CreateSequenceRequest";
const GET: &str = "GetSequenceRequest";
const DROP: &str = "DropSequenceRequest";
const PUT: &str = "PutPagesRequest";
const APPEND: &str = "AppendTokensRequest";
const FETCH: &str = "FetchPagesRequest";
const SELECT: &str = "SelectPagesRequest";
const SET_STATE: &str = "SetPageStateRequest";
const POLICY: &str = "ApplyPolicyRequest";
const REPORT: &str = "ReportAttentionRequest";
const RELEASE: &str = "ReleaseLeaseRequest";
const STATS: &str = "GetStatsRequest";
const TRACE: &str = "SetAccessTraceRequest";
const LOCAL: &str = "LocalCall";
const LOOKUP: &str = "LookupPrefixRequest";
const MOVE: &str = "MoveSequenceRequest";
const DRAIN: &str = "DrainNodeRequest";

const KEYED: &[&str] = &[CREATE, GET, DROP, PUT, APPEND, FETCH, SELECT, SET_STATE, POLICY, REPORT];
const TENANTED: &[&str] = &[
    CREATE, GET, DROP, PUT, APPEND, FETCH, SELECT, SET_STATE, POLICY, REPORT, RELEASE, STATS, LOOKUP,
];
const ONE_LAYER: &[&str] = &[PUT, APPEND, FETCH, SELECT, REPORT];
const LAYER_RANGE: &[&str] = &[SET_STATE, POLICY];
const HEAD_RANGE: &[&str] = &[PUT, APPEND, FETCH, SELECT, SET_STATE, REPORT];
const WRITES: &[&str] = &[PUT, APPEND];
const ACTIONS: &[&str] = &[SET_STATE, POLICY];

macro_rules! fields {
    ($($name:ident = $path:literal in $requests:expr;)*) => {
        $(
            #[doc = concat!("The `", $path, "` field.")]
            pub const $name: Field = Field { path: $path, requests: $requests };
        )*
        /// Every field an error may name.
        pub const ALL: &[Field] = &[$($name),*];
    };
}

fields! {
    TENANT = "tenant" in TENANTED;
    SEQUENCE_ID = "sequence_id" in KEYED;
    LAYOUT = "layout" in &[CREATE, LOOKUP];
    LAYOUT_NUM_LAYERS = "layout.num_layers" in &[CREATE, LOOKUP];
    LAYOUT_NUM_KV_HEADS = "layout.num_kv_heads" in &[CREATE, LOOKUP];
    LAYOUT_NUM_QUERY_HEADS = "layout.num_query_heads" in &[CREATE, LOOKUP];
    LAYOUT_HEAD_DIM = "layout.head_dim" in &[CREATE, LOOKUP];
    LAYOUT_DTYPE = "layout.dtype" in &[CREATE, LOOKUP];
    LAYOUT_PAGE_SIZE = "layout.page_size" in &[CREATE, LOOKUP];
    LAYOUT_LAYER_GROUPS = "layout.layer_groups" in &[CREATE, LOOKUP];
    PREFIX_HASHES = "prefix_hashes" in &[CREATE, LOOKUP];
    LAYER = "layer" in ONE_LAYER;
    LAYER_START = "layer_start" in LAYER_RANGE;
    LAYER_COUNT = "layer_count" in LAYER_RANGE;
    KV_HEAD_START = "kv_head_start" in HEAD_RANGE;
    KV_HEAD_COUNT = "kv_head_count" in HEAD_RANGE;
    FIRST_PAGE = "first_page" in &[PUT, SET_STATE];
    PAGE_COUNT = "page_count" in &[SET_STATE];
    PAGES = "pages" in &[FETCH, SET_STATE];
    PER_HEAD_PAGES = "per_head_pages" in &[FETCH];
    PER_HEAD_PAGES_PAGES = "per_head_pages.pages" in &[FETCH];
    MAX_CHUNK_BYTES = "max_chunk_bytes" in &[FETCH, SELECT];
    NUM_TOKENS = "num_tokens" in WRITES;
    KV = "kv" in WRITES;
    PERSIST = "persist" in WRITES;
    POSITION = "position" in &[APPEND];
    QUERIES = "queries" in &[SELECT, POLICY];
    BUDGET_PAGES = "budget_pages" in &[SELECT];
    SINK_PAGES = "sink_pages" in &[SELECT];
    AGGREGATION = "aggregation" in &[SELECT];
    MODE = "mode" in &[SELECT];
    CANDIDATES = "candidates" in &[SELECT];
    SOFTMAX_SCALE = "softmax_scale" in &[SELECT];
    TOP_P = "top_p" in &[SELECT];
    MIN_PAGES = "min_pages" in &[SELECT];
    REUSE_SIMILARITY = "reuse_similarity" in &[SELECT];
    GATHER_HEADS = "gather_heads" in &[SELECT];
    ATTEND = "attend" in &[SELECT];
    SELECTION_APPEND = "append" in &[SELECT];
    APPEND_NUM_TOKENS = "append.num_tokens" in &[SELECT];
    APPEND_KV = "append.kv" in &[SELECT];
    APPEND_POSITION = "append.position" in &[SELECT];
    APPEND_PERSIST = "append.persist" in &[SELECT];
    SHARD_WORLD = "shard.world" in &[SELECT];
    SHARD_RANK = "shard.rank" in &[SELECT];
    SHARD_OWNERSHIP = "shard.ownership" in &[SELECT];
    SHARD_SCOPE = "shard.scope" in &[SELECT];
    INCLUDE_DATA = "include_data" in &[SELECT];
    SWAP_IN = "swap_in" in &[SELECT];
    DEADLINE_US = "deadline_us" in &[SELECT];
    LEASE_MS = "lease_ms" in &[SELECT];
    SHM = "shm" in &[FETCH, SELECT];
    SHM_REGION_ID = "shm.region_id" in &[FETCH, SELECT];
    SHM_OFFSET = "shm.offset" in &[FETCH, SELECT];
    SHM_LENGTH = "shm.length" in &[FETCH, SELECT];
    LOCAL_CALL = "call" in &[LOCAL];
    ACTION = "action" in ACTIONS;
    OFFLOAD_TIER = "offload.tier" in ACTIONS;
    MIGRATE_TIER = "migrate.tier" in &[SET_STATE];
    SUMMARIZE_ROWS = "summarize.rows" in ACTIONS;
    POLICY_SPEC = "policy" in &[POLICY];
    POLICY_SCORER = "policy.scorer" in &[POLICY];
    POLICY_SNAPKV_KERNEL = "policy.snapkv.kernel" in &[POLICY];
    POLICY_PYRAMID_BETA = "policy.pyramid.beta" in &[POLICY];
    POLICY_ADA_FLOOR = "policy.ada.floor" in &[POLICY];
    BUDGET_TOKENS = "budget_tokens" in &[POLICY];
    TRIGGER = "trigger" in &[POLICY];
    EVERY_TOKENS = "every_tokens" in &[POLICY];
    TOKEN_WEIGHTS = "token_weights" in &[REPORT];
    PAGE_WEIGHTS = "page_weights" in &[REPORT];
    DECAY = "decay" in &[REPORT];
    RECORD = "record" in &[TRACE];
    SAMPLE_RATE = "sample_rate" in &[TRACE];
    MAX_BYTES = "max_bytes" in &[TRACE];
    GROUP = "group" in &[CREATE];
    GROUP_NAME = "group.name" in &[CREATE];
    GROUP_RANK = "group.rank" in &[CREATE];
    GROUP_WORLD = "group.world" in &[CREATE];
    MOVE_PART = "part" in &[MOVE];
    MOVE_HEADER = "header" in &[MOVE];
    MOVE_LANE = "lane" in &[MOVE];
    MOVED_LAYER = "lane.layer" in &[MOVE];
    MOVED_KV_HEAD = "lane.kv_head" in &[MOVE];
    MOVED_FIRST_PAGE = "lane.first_page" in &[MOVE];
    MOVED_PAGES = "lane.pages" in &[MOVE];
    MOVED_PAGE_STATE = "lane.pages.state" in &[MOVE];
    MOVED_PAGE_TOKENS = "lane.pages.tokens" in &[MOVE];
    MOVED_PAGE_KV = "lane.pages.kv" in &[MOVE];
    MOVED_PAGE_COUNTS = "lane.pages.summary_counts" in &[MOVE];
    MOVED_PAGE_REASON = "lane.pages.reason" in &[MOVE];
    MOVED_PAGE_INDEX_ENTRY = "lane.pages.index_entry" in &[MOVE];
    DRAIN_NODE_ID = "node_id" in &[DRAIN];
    DRAIN_PARALLEL = "parallel" in &[DRAIN];
}

/// `lane.pages[index].<field>` of a MoveSequenceRequest, `field` one of the
/// `MOVED_PAGE_*` fields.
pub fn moved_page(index: usize, field: Field) -> String {
    let name = field.path.strip_prefix("lane.pages.").unwrap_or(field.path);
    format!("{}[{index}].{name}", MOVED_PAGES.path)
}

/// `per_head_pages[head].pages[index]`.
pub fn per_head_page(head: usize, index: usize) -> String {
    format!("{}[{head}].pages[{index}]", PER_HEAD_PAGES.path)
}

/// The field of `SelectPagesRequest.append` that stands for the
/// `AppendTokensRequest` field at `path`, if it has one: an append made by
/// a selection names its fields where the caller set them.
pub fn in_selection_append(path: &str) -> Option<Field> {
    [APPEND_NUM_TOKENS, APPEND_KV, APPEND_POSITION, APPEND_PERSIST]
        .into_iter()
        .find(|f| f.path.strip_prefix("append.") == Some(path))
}
