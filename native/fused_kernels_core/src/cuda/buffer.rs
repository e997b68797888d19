//! Device buffers: typed, shaped bytes on one GPU. The NIF wraps them as resources, so weights
//! and recurrent state stay on the device across calls and are freed when the BEAM collects
//! the last reference.

use super::Gpu;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, HostTensor, OwnedTensor};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

pub struct DeviceTensor {
    pub gpu: Arc<Gpu>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    data: CudaSlice<u8>,
}

impl DeviceTensor {
    /// Allocates without initialising (every kernel writes its whole output).
    pub fn uninit(gpu: &Arc<Gpu>, shape: Vec<usize>, dtype: DType) -> Result<Self> {
        let bytes = checked_numel("output", &shape)? * dtype.size();
        gpu.bind()?;
        let data = unsafe { gpu.stream.alloc::<u8>(bytes) }?;
        Ok(DeviceTensor {
            gpu: gpu.clone(),
            shape,
            dtype,
            data,
        })
    }

    pub fn upload(gpu: &Arc<Gpu>, host: &HostTensor<'_>) -> Result<Self> {
        gpu.bind()?;
        let data = gpu.stream.clone_htod(host.bytes)?;
        Ok(DeviceTensor {
            gpu: gpu.clone(),
            shape: host.shape.clone(),
            dtype: host.dtype,
            data,
        })
    }

    /// Copies to the host; waits for the work queued before it on the device's stream.
    pub fn download(&self) -> Result<OwnedTensor> {
        self.gpu.bind()?;
        let data = self.gpu.stream.clone_dtoh(&self.data)?;
        Ok(OwnedTensor {
            data,
            shape: self.shape.clone(),
            dtype: self.dtype,
        })
    }

    /// Fills every byte with `byte` (tests poison outputs with 0xFF, a NaN in every type).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        self.gpu.bind()?;
        let len = self.data.len();
        let stream = self.gpu.stream.clone();
        let (ptr, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut self.data, &stream);
        unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, len, stream.cu_stream()) }
            .map_err(Error::from)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn num_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    /// Refuses a buffer that lives on another device than the one an op runs on.
    pub fn check_device(&self, name: &str, gpu: &Gpu) -> Result<()> {
        if self.gpu.ordinal != gpu.ordinal {
            return Err(Error::Argument(format!(
                "{name} lives on device {} but the op runs on device {}",
                self.gpu.ordinal, gpu.ordinal
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        // The BEAM may collect a buffer on any thread; the free below needs the context.
        let _ = self.gpu.bind();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gpu_for_tests;

    #[test]
    fn device_memory_returns_to_baseline_after_10000_cycles() {
        let Some(gpu) = gpu_for_tests() else { return };
        let bytes = vec![7u8; 1 << 20];
        let host = HostTensor::new("x", &bytes, vec![1 << 18], DType::F32).unwrap();
        let cycle = |n: usize| {
            for _ in 0..n {
                let t = DeviceTensor::upload(&gpu, &host).unwrap();
                drop(t);
            }
        };
        cycle(100);
        let (free0, _) = gpu.mem_info().unwrap();
        cycle(10_000);
        let (free1, _) = gpu.mem_info().unwrap();
        eprintln!("device free memory: before {free0}, after 10,000 cycles {free1}");
        assert!(free0.abs_diff(free1) <= 2 << 20, "{free0} -> {free1}");
        // Downloads see exactly what was uploaded.
        let t = DeviceTensor::upload(&gpu, &host).unwrap();
        assert_eq!(t.download().unwrap().data, bytes);
    }
}
