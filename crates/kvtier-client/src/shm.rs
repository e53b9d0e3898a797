//! The shared-memory data plane, client side. A region is a sealed memfd
//! this process creates and hands to the server over the server's Unix
//! socket; fetches and selections that name a window of it (their `shm`
//! field) get their page bytes written there, and each returned page says
//! where (`shm_offset`, `shm_bytes`). The region is registered as long as
//! this value lives: dropping it (or the process ending) closes the
//! registration connection, and the server lets the region go. The same
//! connection carries calls (`kvtier.v1.LocalCall`): a fetch or selection
//! into the region over it costs one socket round trip, no HTTP/2.

use std::fs::File;
use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream as Connection;
use std::path::Path;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use prost::Message;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;

use crate::pb;
use kvtier_core::poll::AdaptivePoll;

/// What registering a shared-memory region, reading it, or a call over its
/// connection can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// Making, mapping or sealing the memfd failed, or the server's socket
    /// did (a broken connection, no answer to the registration within 10 s).
    #[error("shm region: {0}")]
    Io(#[from] io::Error),
    /// The server answered the registration with an error: its status.
    #[error("the server refused the region: {}: {}", .0.code(), .0.message())]
    Refused(tonic::Status),
    /// The server's answer to the registration, a line that is neither
    /// `ok <id> …` nor `error <code> <message>`.
    #[error("the server's shm socket answered {0:?}")]
    Protocol(String),
    /// A read reached outside the region.
    #[error("{offset}+{len} lies outside the region's {region} bytes")]
    OutOfRange {
        /// Where the read starts, in bytes from the region's start.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The region's size in bytes.
        region: u64,
    },
    /// A reply over the region's connection is not a `LocalReply`.
    #[error("the server's reply over the shm socket: {0}")]
    Reply(#[from] prost::DecodeError),
}

/// How long a call over a region polls for its reply at most before
/// sleeping on it, unless [`ShmRegion::set_spin`] says otherwise. A thread
/// that sleeps is woken tens of microseconds after its reply arrives on
/// these VMs (an empty call: 6-14 us polling, 40-50 sleeping, client and
/// server on different CPUs), most of a small call, which polling saves.
/// A region polls only while its recent replies came within the poll, and
/// on one wait in 16 to see whether they would again
/// (`kvtier_core::poll::AdaptivePoll`): where a call takes longer (a long context's selection),
/// polling takes its CPU from the server's work and shortens nothing (on 2
/// cores, a 100 us poll on every call made a llama3-8b 32K decode step 35
/// -> 40-48 ms, though the CPU is yielded at every turn).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

/// `LocalCall.poll_next_us`'s field number.
const LOCAL_CALL_POLL_NEXT_US: u32 = 4;

/// The frame of an encoded call: its length, then its bytes, with
/// `LocalCall.poll_next_us` set to `server_poll_us` unless that is zero.
/// A field appended to an encoded message is that field set (protobuf
/// merges), so the ask goes with calls however they were encoded (the
/// Python client's, by reflection).
fn frame(call: &[u8], server_poll_us: u32) -> io::Result<Vec<u8>> {
    use prost::encoding::uint32;
    let ask = match server_poll_us {
        0 => 0,
        us => uint32::encoded_len(LOCAL_CALL_POLL_NEXT_US, &us),
    };
    let len = u32::try_from(call.len() + ask)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a call over 4 GiB"))?;
    let mut frame = Vec::with_capacity(4 + call.len() + ask);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(call);
    if ask > 0 {
        uint32::encode(LOCAL_CALL_POLL_NEXT_US, &server_poll_us, &mut frame);
    }
    Ok(frame)
}

/// A shared-memory region registered with a server.
#[derive(Debug)]
pub struct ShmRegion {
    id: u64,
    map: MmapRaw,
    /// The memfd, for processes or runtimes that map the region themselves.
    file: File,
    /// Open as long as the region is the client's; carries its calls.
    connection: Socket,
    /// A call's frame and how much of it is written, until all of it is.
    unsent: Option<(Vec<u8>, usize)>,
    /// Replies the server still owes: calls sent whole, not yet answered.
    owed: usize,
    /// The reply being read: its length's bytes, then its body.
    header: [u8; 4],
    header_read: usize,
    reply: Vec<u8>,
    reply_read: usize,
    /// Whether, and how long, a call polls for its reply before it sleeps
    /// on it: up to the spin, from how long recent replies took.
    poll: AdaptivePoll,
    /// What every call asks of the server's thread
    /// (`LocalCall.poll_next_us`); zero: nothing.
    server_poll_us: u32,
}

impl ShmRegion {
    /// Creates a region of `bytes` and registers it with the server whose
    /// shm socket is `socket`, for `tenant` ("" for the default tenant),
    /// with `token` when the server checks tokens.
    pub async fn register(socket: &Path, bytes: usize, tenant: &str, token: Option<&str>) -> Result<Self, ShmError> {
        let file = sealed_memfd(bytes)?;
        let map = MmapOptions::new().len(bytes).map_raw(&file)?;
        let mut stream = UnixStream::connect(socket).await?;
        let hello = format!("kvtier-shm 1\n{tenant}\n{}\n", token.unwrap_or(""));
        let sent = loop {
            stream.writable().await?;
            match stream.try_io(Interest::WRITABLE, || {
                send_with_fd(&stream, hello.as_bytes(), file.as_raw_fd())
            }) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                sent => break sent?,
            }
        };
        // A short send delivered the descriptor with its first part.
        stream.write_all(&hello.as_bytes()[sent..]).await?;
        let mut line = String::new();
        let mut reader = BufReader::new(&mut stream);
        tokio::time::timeout(Duration::from_secs(10), reader.read_line(&mut line))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer from the shm socket within 10 s"))??;
        let words: Vec<&str> = line.trim_end().splitn(3, ' ').collect();
        match words.as_slice() {
            ["ok", id, _] => {
                let id = id.parse().map_err(|_| ShmError::Protocol(line.clone()))?;
                Ok(Self {
                    id,
                    map,
                    file,
                    connection: Socket {
                        stream: stream.into_std()?,
                        runtime: tokio::runtime::Handle::current(),
                    },
                    unsent: None,
                    owed: 0,
                    header: [0; 4],
                    header_read: 0,
                    reply: Vec::new(),
                    reply_read: 0,
                    poll: AdaptivePoll::new(DEFAULT_SPIN),
                    server_poll_us: 0,
                })
            }
            ["error", code, message] => {
                let code = code.parse().map_err(|_| ShmError::Protocol(line.clone()))?;
                Err(ShmError::Refused(tonic::Status::new(
                    tonic::Code::from_i32(code),
                    *message,
                )))
            }
            _ => Err(ShmError::Protocol(line)),
        }
    }

    /// Runs `call` over the region's connection: the server's reply, its
    /// refusal as a status (`Err(Ok(status))`), or what broke the
    /// connection. One call at a time, hence `&mut`. A call dropped before
    /// it finished (cancelled, timed out) may still take effect, as over
    /// gRPC: the next call first sends the rest of its frame and reads and
    /// discards its reply, so that every call gets its own reply.
    pub async fn call(&mut self, call: &pb::LocalCall) -> Result<Result<pb::LocalReply, tonic::Status>, ShmError> {
        self.call_encoded(&call.encode_to_vec()).await
    }

    /// [`ShmRegion::call`] with the call's bytes as given, and the server
    /// poll asked ([`ShmRegion::set_server_poll`]) appended as a field:
    /// whatever does not decode as a `LocalCall` the server refuses
    /// (INVALID_ARGUMENT), and the connection goes on.
    pub async fn call_encoded(&mut self, call: &[u8]) -> Result<Result<pb::LocalReply, tonic::Status>, ShmError> {
        let reply = pb::LocalReply::decode(self.call_raw(call).await?)?;
        Ok(match reply.error {
            Some(e) => Err(tonic::Status::new(tonic::Code::from_i32(e.code), e.message)),
            None => Ok(reply),
        })
    }

    /// [`ShmRegion::call_encoded`] without decoding the reply: its
    /// `LocalReply` bytes, for callers that decode it their own way (the
    /// Python client, by reflection).
    pub async fn call_raw(&mut self, call: &[u8]) -> Result<&[u8], ShmError> {
        // What dropped calls left: their frames finished, their replies read.
        self.send_rest().await?;
        while self.owed > 0 {
            self.read_reply().await?;
        }
        self.unsent = Some((frame(call, self.server_poll_us)?, 0));
        // Timed only where it is answered: a call dropped on the way is
        // finished, unclocked, by the next.
        let sent = Instant::now();
        self.send_rest().await?;
        self.read_reply().await?;
        self.poll.observe(sent.elapsed());
        Ok(&self.reply)
    }

    /// Writes what is left of the frame being sent. Its progress lives in
    /// `self` and each write either happens or not, so a call dropped here
    /// leaves nothing unaccounted for.
    async fn send_rest(&mut self) -> io::Result<()> {
        loop {
            let Some((frame, written)) = self.unsent.as_mut() else {
                return Ok(());
            };
            if *written == frame.len() {
                self.unsent = None;
                self.owed += 1;
                return Ok(());
            }
            if let Some(n) = self.connection.send_or_wait(&frame[*written..]).await? {
                *written += n;
            }
        }
    }

    /// Reads the next reply into `self.reply`, its progress kept in `self`
    /// as [`Self::send_rest`] keeps its own.
    async fn read_reply(&mut self) -> io::Result<()> {
        self.poll_reply()?;
        while self.header_read < 4 {
            if let Some(n) = self
                .connection
                .read_or_wait(&mut self.header[self.header_read..])
                .await?
            {
                self.header_arrived(n);
            }
        }
        while self.reply_read < self.reply.len() {
            if let Some(n) = self.connection.read_or_wait(&mut self.reply[self.reply_read..]).await? {
                self.reply_read += n;
            }
        }
        self.header_read = 0;
        self.owed -= 1;
        Ok(())
    }

    /// `n` more bytes of the reply's length arrived.
    fn header_arrived(&mut self, n: usize) {
        self.header_read += n;
        if self.header_read == 4 {
            // Every byte of it is read over before it is used.
            self.reply.resize(u32::from_le_bytes(self.header) as usize, 0);
            self.reply_read = 0;
        }
    }

    /// Polls for the reply's first bytes, without sleeping, as long as
    /// `self.poll` says: a thread woken on another CPU starts tens of
    /// microseconds later on a VM, most of a small call.
    fn poll_reply(&mut self) -> io::Result<()> {
        if self.header_read > 0 {
            return Ok(());
        }
        let fd = self.connection.stream.as_raw_fd();
        let header = &mut self.header;
        let polled = self.poll.poll(|| {
            // SAFETY: `header` is valid for writes of its length, and the
            // descriptor is the connection's, open as long as `self`.
            let n = unsafe { libc::recv(fd, header.as_mut_ptr().cast(), header.len(), libc::MSG_DONTWAIT) };
            match n {
                0 => Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => Ok(Some(n as usize)),
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    e => Err(e),
                },
            }
        })?;
        if let Some(n) = polled {
            self.header_arrived(n);
        }
        Ok(())
    }

    /// The id the server gave the region, as a window's `region_id` names it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The region's size in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the region is of zero bytes.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// How long each later call polls for its reply at most before
    /// sleeping on it ([`DEFAULT_SPIN`] until set; zero: never polls). A
    /// call polls only while the region's recent replies came within this:
    /// see [`DEFAULT_SPIN`].
    pub fn set_spin(&mut self, spin: Duration) {
        self.poll.set_cap(spin);
    }

    /// See [`ShmRegion::set_spin`].
    pub fn spin(&self) -> Duration {
        self.poll.cap()
    }

    /// Asks the server's thread for this region's connection to poll for
    /// the next call for up to `poll` after each call
    /// (`LocalCall.poll_next_us`: bounded by the server's
    /// `shm_poll_max_us`, and past the server's own poll given to as many
    /// connections at once as half its cores; microseconds, rounded up, at
    /// most `u32::MAX`); zero: the server's own poll. Where calls come a
    /// few milliseconds apart (an engine's decode loop), each then skips
    /// the thread's wake-up, at the cost of a core polling between them.
    pub fn set_server_poll(&mut self, poll: Duration) {
        let micros = poll.as_nanos().div_ceil(1000);
        self.server_poll_us = u32::try_from(micros).unwrap_or(u32::MAX);
    }

    /// See [`ShmRegion::set_server_poll`].
    pub fn server_poll(&self) -> Duration {
        Duration::from_micros(self.server_poll_us.into())
    }

    /// A window of the region for a request's `shm` field.
    pub fn window(&self, offset: u64, length: u64) -> pb::ShmWindow {
        pb::ShmWindow {
            region_id: self.id,
            offset,
            length,
        }
    }

    /// The whole region as a window.
    pub fn whole(&self) -> pb::ShmWindow {
        self.window(0, self.map.len() as u64)
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        // SAFETY: `[u8]` and `[MaybeUninit<u8>]` have one layout, and
        // `read_uninit` writes only initialised bytes into it.
        self.read_uninit(offset, unsafe {
            &mut *(std::ptr::from_mut(dst) as *mut [MaybeUninit<u8>])
        })
    }

    /// [`Self::read`] into memory not yet initialised: every byte of
    /// `dst` is written when it returns `Ok`.
    pub fn read_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<(), ShmError> {
        let len = dst.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > self.map.len() as u64) {
            return Err(ShmError::OutOfRange {
                offset,
                len,
                region: self.map.len() as u64,
            });
        }
        // SAFETY: the range lies inside the mapping (checked above), which
        // lives as long as `self`; the source is read through a raw pointer
        // (the server may write other windows meanwhile) into `dst`, which
        // is this process's own memory and cannot overlap the mapping.
        unsafe {
            let src = self.map.as_ptr().add(offset as usize);
            std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr().cast::<u8>(), dst.len());
        }
        Ok(())
    }

    /// A served page's bytes, copied out of the region: K rows then V rows
    /// (which a selection's `gather_heads` placed apart, at `shm_v_offset`).
    pub fn page_bytes(&self, page: &pb::Page) -> Result<Vec<u8>, ShmError> {
        let mut out = vec![0u8; page.shm_bytes as usize];
        match page.shm_v_offset {
            Some(v_offset) => {
                let half = out.len() / 2;
                let (k, v) = out.split_at_mut(half);
                self.read(page.shm_offset, k)?;
                self.read(v_offset, v)?;
            }
            None => self.read(page.shm_offset, &mut out)?,
        }
        Ok(out)
    }

    /// The region's memfd: mapping it (shared) elsewhere, a Python array
    /// say, sees the same bytes as [`Self::as_ptr`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The region's first byte, for code that reads the pages in place (a
    /// copy to a device, say). The server writes a window only while a
    /// call naming it runs; its pages' bytes are final when the call
    /// returns, until the window is named again.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }
}

/// A region's connection: non-blocking, and in the reactor of the runtime
/// that registered the region only while a call waits on it
/// ([`Socket::wait_for`]).
#[derive(Debug)]
struct Socket {
    stream: Connection,
    /// Where a wait registers when the caller's executor is not a tokio
    /// runtime's (a registered region may be called from any).
    runtime: tokio::runtime::Handle,
}

impl Socket {
    /// Some bytes read into `buf`, or `None` once the socket was not
    /// readable and has become so (or the read was interrupted): read again.
    async fn read_or_wait(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match (&self.stream).read(buf) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_for(Interest::READABLE).await.map(|()| None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Some of `bytes` sent, or `None` once the socket was not writable and
    /// has become so (or the send was interrupted): send again. Without
    /// SIGPIPE where the server has gone (a process embedding the client
    /// may not ignore it).
    async fn send_or_wait(&self, bytes: &[u8]) -> io::Result<Option<usize>> {
        // SAFETY: `bytes` is valid for reads of its length, and the
        // descriptor is the socket's, open as long as `self`.
        let sent = unsafe {
            libc::send(
                self.stream.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        match sent {
            0 => Err(io::ErrorKind::WriteZero.into()),
            n if n > 0 => Ok(Some(n as usize)),
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::WouldBlock => self.wait_for(Interest::WRITABLE).await.map(|()| None),
                e if e.kind() == io::ErrorKind::Interrupted => Ok(None),
                e => Err(e),
            },
        }
    }

    /// Waits until the socket is ready for `interest`, in the reactor only
    /// meanwhile. A socket kept in it has the reactor's thread woken by
    /// every reply, though the calling thread polled it up already: a
    /// third thread on the CPUs of a client and a server polling for each
    /// other, on every call (2 cores: one such wake-up per call, ~5000 a
    /// second, in an SmolLM2 decode loop). Registered after a read or
    /// write would block, readiness that came between is reported at once.
    async fn wait_for(&self, interest: Interest) -> io::Result<()> {
        let registered = {
            // Entered only to register (the registration keeps its runtime);
            // a guard held across the wait would make the call `!Send`.
            let _entered = tokio::runtime::Handle::try_current()
                .is_err()
                .then(|| self.runtime.enter());
            // SAFETY: the descriptor is borrowed from `self.stream` for the
            // registration's lifetime (`BorrowedFd<'_>`), and `self` is
            // borrowed from the region (`&mut`) as long as the call lives:
            // the descriptor stays open, and the same, until the
            // registration is dropped with this wait or with the call.
            unsafe { AsyncFd::register_with_interest(self.stream.as_fd(), interest)? }
        };
        // The registration, readiness included, goes with this wait.
        let _ready = registered.ready(interest).await?;
        Ok(())
    }
}

/// A memfd of `bytes`, sealed so that neither side can resize it: the
/// server refuses regions that could shrink under its writes.
fn sealed_memfd(bytes: usize) -> io::Result<File> {
    // SAFETY: the name is a NUL-terminated literal; the flags are valid.
    let fd = unsafe { libc::memfd_create(c"kvtier-shm".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor no one else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(bytes as u64)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on the descriptor `file` owns.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// One sendmsg(2) of `bytes` with the descriptor `fd` attached
/// (SCM_RIGHTS); the bytes it sent.
fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // Room for one descriptor, aligned for cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as _;
    // SAFETY: `control` (32 bytes) holds CMSG_SPACE(4) = 24 bytes, so the
    // first header and its data lie inside it; `msg` points at `iov`, over
    // `bytes`, which the kernel only reads.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_frame_carries_the_server_poll_asked_whoever_encoded_the_call() {
        let call = pb::LocalCall {
            call: Some(pb::local_call::Call::AppendTokens(pb::AppendTokensRequest {
                sequence_id: "s".into(),
                num_tokens: 3,
                ..Default::default()
            })),
            ..Default::default()
        };
        for ask in [0, 1, 5000, u32::MAX] {
            let framed = frame(&call.encode_to_vec(), ask).unwrap();
            let len = u32::from_le_bytes(framed[..4].try_into().unwrap()) as usize;
            assert_eq!(len, framed.len() - 4);
            let sent = pb::LocalCall::decode(&framed[4..]).unwrap();
            assert_eq!(sent.call, call.call, "the call itself, unchanged");
            assert_eq!(sent.poll_next_us, ask);
        }
    }
}
