use fused_kernels_core::cuda::nvrtc::{compile, Target};
use fused_kernels_core::kernels::RNN_CLUSTER;
use std::time::Instant;
fn main() {
    let extra: Vec<String> = std::env::args().skip(1).collect();
    for _ in 0..2 {
        let mut d = vec!["-DFK_ONLY=rnn_cluster_lstm_f32".to_string()];
        d.extend(extra.iter().cloned());
        let t = Instant::now();
        let r = compile(
            "rnn_cluster",
            &RNN_CLUSTER.source(),
            "sm_90",
            Target::Cubin,
            &d,
        );
        println!(
            "{:?} {:.0} ms ok={}",
            extra,
            t.elapsed().as_secs_f64() * 1e3,
            r.is_ok()
        );
        if let Err(e) = r {
            println!("{e}");
        }
    }
}
