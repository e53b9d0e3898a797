//! The io_uring engine: one thread owns the ring, takes batches of
//! operations from a channel, keeps up to the queue depth in flight and
//! completes each operation when its CQE arrives.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use io_uring::{IoUring, opcode, types};

use super::op::{IoOp, OpKind};

#[derive(Debug)]
pub(crate) struct Uring {
    tx: Option<Sender<Vec<IoOp>>>,
    thread: Option<JoinHandle<()>>,
}

/// Checks that this process may use io_uring at all (containers often
/// forbid it): sets up a ring and completes a no-op through it.
pub(crate) fn probe() -> io::Result<()> {
    let mut ring = IoUring::new(2)?;
    let nop = opcode::Nop::new().build().user_data(7);
    // SAFETY: a no-op references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| io::Error::other("submission queue full"))?;
    ring.submit_and_wait(1)?;
    match ring.completion().next() {
        Some(cqe) if cqe.user_data() == 7 && cqe.result() >= 0 => Ok(()),
        Some(cqe) => Err(io::Error::from_raw_os_error(-cqe.result())),
        None => Err(io::Error::other("no completion for a no-op")),
    }
}

impl Uring {
    pub(crate) fn start(file: Arc<File>, depth: u32) -> io::Result<Self> {
        let ring = IoUring::new(depth.next_power_of_two().max(2))?;
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("kvtier-uring".into())
            .spawn(move || run(ring, &file, depth as usize, &rx))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    pub(crate) fn submit(&self, ops: Vec<IoOp>) {
        if let Err(failed) = self.tx.as_ref().expect("engine running").send(ops) {
            for op in failed.0 {
                op.finish(Err(io::Error::other("the io_uring thread has stopped")));
            }
        }
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An operation in flight and how much of it is done (short transfers are
/// resubmitted for the rest).
struct InFlight {
    op: IoOp,
    done: usize,
}

/// Operations the kernel may still be using. If the ring thread unwinds,
/// they are abandoned: buffers leaked rather than freed under the kernel's
/// feet, waiters told the engine stopped.
struct Pending(HashMap<u64, InFlight>);

impl Drop for Pending {
    fn drop(&mut self) {
        for (_, f) in self.0.drain() {
            f.op.abandon();
        }
    }
}

fn run(mut ring: IoUring, file: &File, depth: usize, rx: &Receiver<Vec<IoOp>>) {
    let fd = types::Fd(file.as_raw_fd());
    let mut queue: VecDeque<InFlight> = VecDeque::new();
    let mut pending = Pending(HashMap::new());
    let mut next_key = 0u64;
    let mut open = true;
    loop {
        // Take new work: block only when there is nothing else to do.
        if open && queue.is_empty() && pending.0.is_empty() {
            match rx.recv() {
                Ok(ops) => queue.extend(ops.into_iter().map(|op| InFlight { op, done: 0 })),
                Err(_) => open = false,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(ops) => queue.extend(ops.into_iter().map(|op| InFlight { op, done: 0 })),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if !open && queue.is_empty() && pending.0.is_empty() {
            return;
        }
        // Fill the ring up to the queue depth.
        while pending.0.len() < depth {
            let Some(mut f) = queue.pop_front() else { break };
            let remaining = (f.op.len - f.done) as u32;
            let offset = f.op.offset + f.done as u64;
            // SAFETY: `done < len <= capacity`, so the pointer stays inside
            // the buffer's allocation.
            let at = unsafe { f.op.buf.as_mut_ptr().add(f.done) };
            let entry = match f.op.kind {
                OpKind::Read => opcode::Read::new(fd, at, remaining).offset(offset).build(),
                OpKind::Write => opcode::Write::new(fd, at.cast_const(), remaining)
                    .offset(offset)
                    .build(),
            }
            .user_data(next_key);
            // SAFETY: the entry points into `f.op.buf`, which moves into
            // `pending` below and stays there, unmoved on the heap, until its
            // completion is reaped; the file outlives the ring thread.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                queue.push_front(f);
                break;
            }
            pending.0.insert(next_key, f);
            next_key += 1;
        }
        if pending.0.is_empty() {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // The ring is unusable: fail everything not yet submitted and
            // wait out what the kernel holds (never free a buffer it uses).
            for f in queue.drain(..) {
                f.op.finish(Err(io::Error::new(e.kind(), e.to_string())));
            }
            drain_after_failure(&mut ring, &mut pending);
            return;
        }
        let reaped: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (key, res) in reaped {
            let Some(mut f) = pending.0.remove(&key) else { continue };
            if res < 0 {
                f.op.finish(Err(io::Error::from_raw_os_error(-res)));
            } else if res == 0 {
                let what = if f.op.kind == OpKind::Read {
                    "read past the end of the file"
                } else {
                    "wrote nothing"
                };
                f.op.finish(Err(io::Error::new(io::ErrorKind::UnexpectedEof, what)));
            } else {
                f.done += res as usize;
                if f.done < f.op.len {
                    queue.push_front(f); // short transfer: the rest next round
                } else {
                    f.op.finish(Ok(()));
                }
            }
        }
    }
}

/// Waits until the kernel has completed every submitted operation, failing
/// each; used only when the ring itself errors.
fn drain_after_failure(ring: &mut IoUring, pending: &mut Pending) {
    while !pending.0.is_empty() {
        if ring.submit_and_wait(1).is_err() {
            return; // cannot even wait: `Pending` abandons what is left
        }
        let reaped: Vec<u64> = ring.completion().map(|c| c.user_data()).collect();
        for key in reaped {
            if let Some(f) = pending.0.remove(&key) {
                f.op.finish(Err(io::Error::other(
                    "io_uring failed while the operation was in flight",
                )));
            }
        }
    }
}
