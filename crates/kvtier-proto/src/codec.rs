//! The protobuf codec of `kvtier.v1`: tonic-prost's, except for who is
//! blamed when a message does not decode, and how a message's buffer
//! grows. tonic-prost reports INTERNAL either way; a request that does not
//! decode is the client's fault (INVALID_ARGUMENT, which the proto promises
//! for malformed requests), while a response that does not decode is the
//! server's (INTERNAL).

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Who sent a message, and so which code a decode failure gets.
pub trait Sender {
    /// The code for a message of this type that does not decode.
    const UNDECODABLE: Code;
    /// `request` or `response`, for the message.
    const KIND: &'static str;
}

/// prost's codec with kvtier's two changes: an encoder that reserves room
/// for the whole message at once, and a decoder whose failure has the code
/// the message's [`Sender`] gives it (INVALID_ARGUMENT for a request).
#[derive(Debug, Clone, Copy)]
pub struct KvTierCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for KvTierCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for KvTierCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Sender + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = KvTierEncoder<T>;
    type Decoder = KvTierDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        KvTierEncoder(ProstCodec::<T, U>::default().encoder())
    }

    fn decoder(&mut self) -> Self::Decoder {
        KvTierDecoder(ProstCodec::<T, U>::default().decoder())
    }
}

/// [`KvTierCodec`]'s encoder.
#[derive(Debug)]
pub struct KvTierEncoder<T>(ProstEncoder<T>);

impl<T: Message> Encoder for KvTierEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // Room for the whole message at once. tonic's buffer starts at
        // 8 KiB and grew by doubling as pages were written into it: a
        // megabyte of pages was copied about once more on the way, into
        // fresh memory faulted in at every step.
        buf.reserve(item.encoded_len());
        self.0.encode(item, buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// [`KvTierCodec`]'s decoder.
#[derive(Debug)]
pub struct KvTierDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + Sender> Decoder for KvTierDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|e| {
            Status::new(
                U::UNDECODABLE,
                format!("the {} message does not decode: {}", U::KIND, e.message()),
            )
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

macro_rules! sent_by {
    ($code:expr, $kind:literal => $($message:ident),+ $(,)?) => {
        $(impl Sender for crate::v1::$message {
            const UNDECODABLE: Code = $code;
            const KIND: &'static str = $kind;
        })+
    };
}

sent_by!(Code::InvalidArgument, "request" =>
    CreateSequenceRequest, GetSequenceRequest, DropSequenceRequest, PutPagesRequest,
    AppendTokensRequest, FetchPagesRequest, SelectPagesRequest, ReleaseLeaseRequest,
    SetPageStateRequest, ApplyPolicyRequest, ReportAttentionRequest, GetStatsRequest,
    SetAccessTraceRequest, LookupPrefixRequest, GetClusterRequest, DrainNodeRequest, MoveSequenceRequest,
);
sent_by!(Code::Internal, "response" =>
    CreateSequenceResponse, SequenceInfo, DropSequenceResponse, PutPagesResponse,
    AppendTokensResponse, FetchPagesResponse, SelectPagesResponse, PrefetchResponse,
    ReleaseLeaseResponse, SetPageStateResponse, ApplyPolicyResponse, ReportAttentionResponse, Stats,
    AccessTraceStatus, LookupPrefixResponse, ClusterView, DrainProgress, MoveSequenceResponse,
);
