//! The CUDA path of `scaled_softmax` (kernels/scaled_softmax.cu): one warp per row up to 1024
//! columns, one block per row above.

use super::common::{geometry, Params};
use crate::cuda::DeviceTensor;
use crate::error::{arg_error, Result};
use crate::kernels::{kernel_name, SCALED_SOFTMAX};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// The CUDA implementation: `out` must have `x`'s shape and type.
pub fn cuda(x: &DeviceTensor, out: &mut DeviceTensor, p: Params) -> Result<()> {
    let g = geometry(&x.shape)?;
    if out.shape != x.shape || out.dtype != x.dtype {
        return Err(arg_error("out: must have the shape and type of x"));
    }
    let tname = x.dtype.kernel_suffix("x")?;
    // 16-byte accesses need every row to start on a 16-byte boundary (buffers are 256-byte
    // aligned) and K to hold whole 16-byte runs.
    let run = 16 / x.dtype.size();
    let vec = |k: usize| {
        if g.sk.is_multiple_of(run) && k.is_multiple_of(run) {
            "v"
        } else {
            ""
        }
    };
    let gpu = x.gpu.clone();
    let (sq, sk, scale, causal) = (g.sq as i32, g.sk as i32, p.scale as f32, p.causal as i32);
    let (function, cfg) = if g.sk <= 32 * 32 {
        // One warp per row: the smallest K with 32*K >= sk, 4 rows per 128-thread block.
        let k = [1, 2, 4, 8, 16, 32]
            .into_iter()
            .find(|k| 32 * k >= g.sk)
            .unwrap_or(32);
        let blocks = g.rows.div_ceil(4) as u32;
        (
            kernel_name("scaled_softmax_warp", &[&tname, &k, &vec(k)]),
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    } else {
        let name = match g.sk {
            sk if sk <= 256 * 8 => kernel_name("scaled_softmax_block", &[&tname, &8, &vec(8)]),
            sk if sk <= 256 * 16 => kernel_name("scaled_softmax_block", &[&tname, &16, &vec(16)]),
            _ => kernel_name("scaled_softmax_stream", &[&tname]),
        };
        (
            name,
            LaunchConfig {
                grid_dim: (g.rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    };
    let f = gpu.function(&SCALED_SOFTMAX, &function)?;
    let rows = g.rows as i64;
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(x.slice()).arg(out.slice_mut());
    if g.sk <= 32 * 32 {
        launch.arg(&rows);
    }
    launch.arg(&sq).arg(&sk).arg(&scale).arg(&causal);
    unsafe { launch.launch(cfg) }?;
    Ok(())
}
