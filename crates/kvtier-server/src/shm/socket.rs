//! The registration socket: a Unix stream socket where a client hands the
//! server a sealed memfd (SCM_RIGHTS) and gets its region's id back.
//!
//! The client sends, in one message with the descriptor attached:
//! `kvtier-shm 1\n<tenant>\n<token>\n` (an empty line for no token). The
//! server answers `ok <region id> <bytes>\n`, or `error <gRPC code number>
//! <message>\n` and closes. After `ok` the connection may carry calls
//! (`calls.rs`, `kvtier.v1.LocalCall`); its closing gives the region up.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{TenantId, wire};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

use super::Regions;
use super::calls::{CallContext, Connections};
use crate::auth::{Auth, Caller};
use crate::status::field_status;

/// How long a new connection may take to send its registration.
const HELLO_TIME: Duration = Duration::from_secs(10);

/// The registration's first line.
const MAGIC: &str = "kvtier-shm 1";

/// Largest registration message: three short lines.
const MAX_HELLO: usize = 4096;

/// Binds `path`, replacing a socket file no server answers on any more (one
/// a killed server left); refuses one a live server is listening on, and
/// any path that is not a socket (a mistyped flag must not delete a file).
pub(crate) fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
        Ok(m) if !m.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            ));
        }
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another server is listening on this socket",
                ));
            }
            std::fs::remove_file(path)?;
        }
    }
    UnixListener::bind(path)
}

/// Connections that have not registered yet, at once: each may hold a
/// descriptor until it does.
const MAX_PENDING: usize = 64;

/// Accepts registrations until `stop`; then ends the registered
/// connections and removes the socket file.
pub(crate) async fn serve(
    listener: UnixListener,
    path: PathBuf,
    ctx: CallContext,
    auth: Arc<Auth>,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    let pending = Arc::new(Semaphore::new(MAX_PENDING));
    let connections = Arc::new(Connections::default());
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => match Arc::clone(&pending).try_acquire_owned() {
                    Ok(slot) => {
                        let registered = Registered { ctx: ctx.clone(), connections: Arc::clone(&connections) };
                        tokio::spawn(connection(stream, registered, Arc::clone(&auth), slot));
                    }
                    // Too many half-open registrations: this one is closed.
                    Err(_) => drop(stream),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "shm socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            () = &mut stop => break,
        }
    }
    // Joining waits for calls running to finish: off the runtime's workers.
    let _ = tokio::task::spawn_blocking(move || connections.close_all()).await;
    let _ = std::fs::remove_file(path);
}

/// Where a registered connection goes.
struct Registered {
    ctx: CallContext,
    connections: Arc<Connections>,
}

async fn connection(mut stream: UnixStream, to: Registered, auth: Arc<Auth>, pending: OwnedSemaphorePermit) {
    let regions = Arc::clone(&to.ctx.regions);
    let registered = match tokio::time::timeout(HELLO_TIME, read_hello(&stream)).await {
        Ok(Ok((hello, fds))) => register(&regions, &auth, &hello, fds),
        Ok(Err(e)) => Err(Status::invalid_argument(format!("reading the registration: {e}"))),
        Err(_) => Err(Status::deadline_exceeded("no registration within 10 s")),
    };
    drop(pending);
    let (id, bytes, caller) = match registered {
        Ok(region) => region,
        Err(status) => {
            let line = format!(
                "error {} {}\n",
                status.code() as i32,
                status.message().replace('\n', " ")
            );
            let _ = stream.write_all(line.as_bytes()).await;
            return;
        }
    };
    tracing::debug!(region = id, bytes, "shm region registered");
    let served = async {
        stream.write_all(format!("ok {id} {bytes}\n").as_bytes()).await?;
        // Its calls block on the socket in a thread of their own.
        let stream = stream.into_std()?;
        stream.set_nonblocking(false)?;
        to.connections.start(id, stream, caller, to.ctx)
    };
    if let Err(e) = served.await {
        tracing::debug!(region = id, error = %e, "shm connection ended at registration");
        regions.remove(id);
    }
}

/// Checks a registration and maps its region: its id, size, and the
/// caller its calls act as.
fn register(regions: &Regions, auth: &Auth, hello: &[u8], mut fds: Vec<OwnedFd>) -> Result<(u64, u64, Caller), Status> {
    let text = std::str::from_utf8(hello).map_err(|_| Status::invalid_argument("the registration is not UTF-8"))?;
    let mut lines = text.split('\n');
    let (Some(MAGIC), Some(tenant), Some(token), Some("")) = (lines.next(), lines.next(), lines.next(), lines.next())
    else {
        return Err(Status::invalid_argument(format!(
            "the registration must be `{MAGIC}\\n<tenant>\\n<token>\\n`"
        )));
    };
    let tenant = TenantId::parse(wire::TENANT.path, tenant).map_err(field_status)?;
    let caller = auth.caller_with_token(token)?;
    caller.check_tenant(&tenant)?;
    if fds.len() != 1 {
        return Err(Status::invalid_argument(format!(
            "the registration must carry one file descriptor, not {}",
            fds.len()
        )));
    }
    let file = File::from(fds.remove(0));
    let (id, bytes) = regions
        .register(tenant, &file)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok((id, bytes, caller))
}

/// Reads the registration: up to its last line, with the descriptors
/// that came with it.
async fn read_hello(stream: &UnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut hello = Vec::new();
    let mut fds = Vec::new();
    let mut buf = [0u8; MAX_HELLO];
    while hello.iter().filter(|&&b| b == b'\n').count() < 3 {
        stream.readable().await?;
        let read = stream.try_io(Interest::READABLE, || {
            recv_with_fds(stream.as_raw_fd(), &mut buf, &mut fds)
        });
        let n = match read {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before registering",
            ));
        }
        hello.extend_from_slice(&buf[..n]);
        if hello.len() > MAX_HELLO {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the registration is too long",
            ));
        }
    }
    Ok((hello, fds))
}

/// One recvmsg(2): bytes into `buf`, and every descriptor that came with
/// them into `fds` (owned from here on, so none leaks).
fn recv_with_fds(fd: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for a few descriptors, aligned for cmsghdr.
    let mut control = [0u64; 16];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both live
    // and writable for the call, with their true lengths.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // The kernel closed what did not fit; the registration is refused.
    let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0;
    // SAFETY: the kernel filled `msg`'s control area; CMSG_FIRSTHDR and
    // CMSG_NXTHDR walk it within msg_controllen, and each SCM_RIGHTS
    // header's data holds (cmsg_len - header) / size_of(c_int) descriptors,
    // now open in this process and owned by no one else.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let len = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for i in 0..len / std::mem::size_of::<libc::c_int>() {
                    let raw = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if truncated {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "too many file descriptors"));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_path_that_is_not_a_socket_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, b"precious").unwrap();
        let err = bind(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
        // A socket no server answers on (one a killed server left) is replaced.
        let socket = dir.path().join("shm.sock");
        drop(bind(&socket).unwrap());
        assert!(bind(&socket).is_ok());
    }
}
