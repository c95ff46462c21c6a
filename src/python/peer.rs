//! `gradhub._core.PeerLinks`: a group's point-to-point links
//! (`crate::peer`) for the torch backend's send and recv.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use std::sync::{Arc, Mutex};

use super::{queue_callback, Args};
use crate::peer::{PeerLinks, Receive};

/// Whether a receive's outcome comes while it is being posted.
enum Told {
    Posting(Option<Result<u32, String>>),
    Later,
}

fn received(r: Result<u32, String>) -> Args {
    match r {
        Ok(src) => Args::Received(Some(src), None),
        Err(e) => Args::Received(None, Some(e)),
    }
}

#[pyclass(module = "gradhub._core", name = "PeerLinks")]
pub struct PyPeerLinks {
    links: PeerLinks,
}

impl PyPeerLinks {
    pub(super) fn new(links: PeerLinks) -> PyPeerLinks {
        PyPeerLinks { links }
    }
}

#[pymethods]
impl PyPeerLinks {
    /// `host:port`, where the group's other members reach this one.
    #[getter]
    fn address(&self) -> String {
        self.links.address().to_string()
    }

    /// Send the `nbytes` at `ptr` (memory of `owner`, which the caller
    /// keeps alive and unchanged until this returns) to member `dst`,
    /// listening at `addr`; blocks, without the GIL, until written.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        dst: u32,
        addr: &str,
        tag: i32,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
    ) -> PyResult<()> {
        if ptr == 0 && nbytes > 0 {
            return Err(PyValueError::new_err("null buffer"));
        }
        let sent = py.detach(|| {
            // SAFETY: the caller passes the data pointer and size of a
            // contiguous buffer that `owner` keeps alive during this call.
            let data =
                if nbytes == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(ptr as *const u8, nbytes) } };
            self.links.send(dst, addr, tag, data)
        });
        drop(owner);
        sent.map_err(|e| PyRuntimeError::new_err(format!("gradhub: {e}")))
    }

    /// Post a receive of `nbytes` into `ptr` (memory of `owner`, kept alive
    /// by the receive) from member `src` (None: any) with `tag`;
    /// `callback(sender, error)` runs once it is filled or failed, on
    /// gradhub's callback thread. The ticket to cancel it by while it
    /// waits, or None if it was done at once.
    #[allow(clippy::too_many_arguments)]
    fn post_recv(
        &self,
        py: Python<'_>,
        src: Option<u32>,
        tag: i32,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        callback: Py<PyAny>,
    ) -> PyResult<Option<u64>> {
        if ptr == 0 && nbytes > 0 {
            return Err(PyValueError::new_err("null buffer"));
        }
        if !callback.bind(py).is_callable() {
            return Err(PyValueError::new_err("post_recv needs a callable"));
        }
        // A receive matched while it is posted (its message had come) is
        // told here, on the caller's thread, which holds the GIL: no trip
        // through the callback thread. One matched later is told there.
        let slot: Arc<Mutex<Told>> = Arc::new(Mutex::new(Told::Posting(None)));
        let (s, cb) = (slot.clone(), callback.clone_ref(py));
        let done = Box::new(move |r: Result<u32, String>| {
            let mut told = s.lock().unwrap_or_else(|e| e.into_inner());
            match &mut *told {
                Told::Posting(at_once) => *at_once = Some(r),
                Told::Later => queue_callback(cb, received(r)),
            }
        });
        // SAFETY: the caller passes a contiguous, writable buffer owned by
        // `owner`, which the receive holds until it is done or cancelled.
        let recv = unsafe { Receive::new(ptr as *mut u8, nbytes, Box::new(owner), done) };
        let ticket = py.detach(|| self.links.post(src, tag, recv));
        let at_once = std::mem::replace(&mut *slot.lock().unwrap_or_else(|e| e.into_inner()), Told::Later);
        if let Told::Posting(Some(r)) = at_once {
            let (src, err) = match r {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e)),
            };
            callback.call1(py, (src, err))?;
        }
        Ok(ticket)
    }

    /// Withdraw a waiting receive: True if it was still waiting (it is then
    /// never filled and its callback never runs).
    fn cancel(&self, ticket: u64) -> bool {
        self.links.cancel(ticket)
    }

    /// Close every link; waiting receives fail with `why`.
    fn close(&self, py: Python<'_>, why: &str) {
        py.detach(|| self.links.close(why))
    }
}
