//! The portable engine: `pread`/`pwrite` on a pool of threads, as many as
//! the queue depth, so a batch still has that many operations in flight.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::op::{IoOp, OpKind};

#[derive(Debug)]
pub(crate) struct Psync {
    tx: Option<Sender<IoOp>>,
    workers: Vec<JoinHandle<()>>,
}

impl Psync {
    /// Starts `threads` I/O threads (at least one); an error if the OS
    /// refuses one (those started stop again).
    pub(crate) fn start(file: Arc<File>, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<IoOp>();
        let rx = Arc::new(Mutex::new(rx));
        let mut engine = Self {
            tx: Some(tx),
            workers: Vec::new(),
        };
        for i in 0..threads.max(1) {
            let (file, rx) = (Arc::clone(&file), Arc::clone(&rx));
            let worker = std::thread::Builder::new()
                .name(format!("kvtier-psync-{i}"))
                .spawn(move || worker(&file, &rx))?;
            engine.workers.push(worker);
        }
        Ok(engine)
    }

    pub(crate) fn submit(&self, ops: Vec<IoOp>) {
        let tx = self.tx.as_ref().expect("engine running");
        for op in ops {
            if let Err(failed) = tx.send(op) {
                failed
                    .0
                    .finish(Err(std::io::Error::other("the I/O threads have stopped")));
            }
        }
    }
}

fn worker(file: &File, rx: &Mutex<Receiver<IoOp>>) {
    loop {
        let op = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(op) => op,
            Err(_) => return,
        };
        let mut op = op;
        // The transfer covers `len` bytes of the buffer's capacity, which
        // may exceed its logical length; widen it for the call.
        let saved = op.buf.len();
        op.buf.set_len(op.len);
        let result = match op.kind {
            OpKind::Read => file.read_exact_at(&mut op.buf, op.offset),
            OpKind::Write => file.write_all_at(&op.buf, op.offset),
        };
        op.buf.set_len(saved);
        op.finish(result);
    }
}

impl Drop for Psync {
    fn drop(&mut self) {
        drop(self.tx.take());
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
