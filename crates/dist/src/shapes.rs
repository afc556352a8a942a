//! The argument rules of the collectives, the same for every backend (so the threads and MPI
//! backends refuse the same calls with the same words). Each returns the problem, which the
//! backend turns into a [`crate::CommError::Usage`] naming its rank and the op.

/// `send` holds `size` blocks of `recv.len()` elements.
pub(crate) fn reduce_scatter(size: usize, send: usize, recv: usize) -> Result<(), String> {
    if send == size * recv {
        Ok(())
    } else {
        Err(format!(
            "send has {send} elements, expected size {size} × recv {recv}"
        ))
    }
}

/// `recv` holds `size` copies of `send`'s length.
pub(crate) fn all_gather(size: usize, send: usize, recv: usize) -> Result<(), String> {
    if recv == send * size {
        Ok(())
    } else {
        Err(format!("recv has {recv} elements, expected size × {send}"))
    }
}

/// An in-place reduce-scatter or all-gather buffer of `len` elements is `size` equal blocks.
pub(crate) fn blocks(size: usize, len: usize) -> Result<(), String> {
    if len.is_multiple_of(size) {
        Ok(())
    } else {
        Err(format!("{len} elements do not make {size} equal blocks"))
    }
}

/// `send` and `recv` are equal and cut into `size` equal blocks.
pub(crate) fn all_to_all(size: usize, send: usize, recv: usize) -> Result<(), String> {
    if send.is_multiple_of(size) && recv == send {
        Ok(())
    } else {
        Err(format!(
            "send {send} and recv {recv} must be equal and divisible by {size}"
        ))
    }
}

/// One count per rank for each side, summing to the buffers' lengths.
pub(crate) fn all_to_all_v(
    size: usize,
    (send, send_counts): (usize, &[usize]),
    (recv, recv_counts): (usize, &[usize]),
) -> Result<(), String> {
    if send_counts.len() != size || recv_counts.len() != size {
        return Err(format!(
            "{} send and {} receive counts for a group of {size}",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    let (s, r) = (
        send_counts.iter().sum::<usize>(),
        recv_counts.iter().sum::<usize>(),
    );
    if s > send || r > recv {
        return Err(format!(
            "counts of {s} to send and {r} to receive exceed the buffers ({send}, {recv})"
        ));
    }
    Ok(())
}

/// `peer` (a root, a destination, a source: `what`) is a rank of a group of `size`.
pub(crate) fn member(size: usize, peer: usize, what: &str) -> Result<(), String> {
    if peer < size {
        Ok(())
    } else {
        Err(format!("{what} {peer} is not in a group of {size}"))
    }
}

/// A received message of `got` elements fits a buffer of `want`.
pub(crate) fn message(src: usize, tag: u32, got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "message from rank {src} (tag {tag}) has {got} elements, the buffer {want}"
        ))
    }
}
