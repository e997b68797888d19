//! Buffers sized by the caller are refused as out of memory, never aborted on.

use fused_kernels_core::alloc::{check, count, try_vec, try_zeroed};
use fused_kernels_core::operand::{Operand, Placement};
use fused_kernels_core::ops::rnn::{run, Cell, Layer, Precision};
use fused_kernels_core::ops::Backend;
use fused_kernels_core::{DType, Error, HostTensor};

#[test]
fn small_requests_are_served() {
    let v: Vec<f32> = try_zeroed("small", &[3, 5]).unwrap();
    assert_eq!(v.len(), 15);
    assert!(v.iter().all(|x| *x == 0.0));
    assert_eq!(try_vec("fill", 4, 7u8).unwrap(), vec![7u8; 4]);
}

#[test]
fn overflowing_or_huge_requests_are_out_of_memory() {
    let e = count("product", &[usize::MAX, 2]).unwrap_err();
    assert_eq!(e.kind(), "out_of_memory", "{e}");
    let e = check("bytes", usize::MAX / 2, 8).unwrap_err();
    assert_eq!(e.kind(), "out_of_memory", "{e}");
    // 64 TiB: more than any CI or workstation has available.
    let e = try_vec::<f64>("huge", 1 << 43, 0.0).unwrap_err();
    assert_eq!(e.kind(), "out_of_memory", "{e}");
    assert!(e.to_string().contains("host: huge needs"), "{e}");
}

/// The example from the issue: one LSTM layer of 4096 units over 2,097,152 steps needs a
/// 128 GiB input projection on the CPU; it must be refused, not abort the process.
#[test]
fn rnn_cpu_refuses_a_128_gib_projection() {
    // On a host with that much memory free the request is legitimately served (slowly).
    let avail_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t
                .lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .to_owned();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib >> 20);
    if avail_gib >= 128 {
        eprintln!("skipped: {avail_gib} GiB available, the 128 GiB request would be served");
        return;
    }
    let (t, units) = (2_097_152usize, 4096usize);
    let xb = vec![0u8; t * 4];
    let x = Operand::Host(HostTensor::new("x", &xb, vec![1, t, 1], DType::F32).unwrap());
    let ik = vec![0u8; units * 4];
    let hk = vec![0u8; units * units * 4];
    let bias = vec![0u8; units * 4];
    let op = |b: &'static [u8], shape: Vec<usize>| {
        Operand::Host(HostTensor::new("w", b, shape, DType::F32).unwrap())
    };
    let (ik, hk, bias): (&'static [u8], &'static [u8], &'static [u8]) = (
        Box::leak(ik.into_boxed_slice()),
        Box::leak(hk.into_boxed_slice()),
        Box::leak(bias.into_boxed_slice()),
    );
    let layer = Layer {
        input_kernel: (0..4).map(|_| op(ik, vec![1, units])).collect(),
        hidden_kernel: (0..4).map(|_| op(hk, vec![units, units])).collect(),
        bias: (0..4).map(|_| op(bias, vec![units])).collect(),
        initial_state: vec![],
    };
    let started = std::time::Instant::now();
    let r = run(
        Backend::Cpu,
        Cell::Lstm,
        &x,
        &[layer],
        false,
        Placement::Host,
        Precision::F32,
    );
    let e = match r {
        Err(e) => e,
        Ok(_) => panic!("a 128 GiB request was served"),
    };
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert!(e.to_string().contains("rnn"), "{e}");
    assert!(
        started.elapsed().as_secs() < 30,
        "refusal took {:?}",
        started.elapsed()
    );
}
