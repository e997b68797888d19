//! The persistent LSTM/GRU frame kernel (engine/persist.rs) against the graph path: bit for bit
//! over odd sizes and batch rows, against the CPU engine, and a stream that survives the kernel
//! being stopped and relaunched (idle time-out, windows, reset, init_state, another state,
//! drop). A test binary of its own, its tests one at a time: the persistent kernels' block
//! budget is per process, and other engines running at once would leave these frames on the
//! graph path. Skipped without a GPU (fails with FUSED_KERNELS_REQUIRE_GPU=1).

mod support;

use fused_kernels_core::engine::cuda::{CudaEngine, CudaState};
use fused_kernels_core::engine::plan::{Kind, Spec};
use support::backbone::{
    cpu_predict, engines, gpu_predict, random_params, rnn_spec, spec, to_params,
};
use support::{gpu_alone, rel_l2, Rng};

/// `n` frames of `b` rows from `st`, every output kept.
fn frames_out(e: &CudaEngine, st: &mut CudaState, x: &[f32], n: usize) -> Vec<Vec<f32>> {
    let (b, emb) = (st.batch, e.spec.embed);
    (0..n)
        .map(|i| {
            let mut out = vec![f32::NAN; b * e.spec.hidden];
            let f = &x[(i % 7) * b * emb..(i % 7 + 1) * b * emb];
            e.step(st, f, &mut out).unwrap();
            out
        })
        .collect()
}

/// Runs `calls` on this thread while `framing` frames back to back (from state `st`, the rows of
/// `x`) on another for `span`, starting 100 ms into it (its kernel never idles out meanwhile).
/// Returns what `calls` returned and the frames that ran on the framing engine's kernel.
fn beside_framing<T>(
    framing: &CudaEngine,
    st: &mut CudaState,
    x: &[f32],
    span: std::time::Duration,
    calls: impl FnOnce() -> T,
) -> (T, u64) {
    std::thread::scope(|scope| {
        let t = scope.spawn(move || {
            let t0 = std::time::Instant::now();
            let (before, _) = framing.persistent_counts().unwrap();
            while t0.elapsed() < span {
                frames_out(framing, st, x, 1);
            }
            framing.persistent_counts().unwrap().0 - before
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let got = calls();
        (got, t.join().unwrap())
    })
}

#[test]
fn gpu_persistent_frames_equal_the_graph_frames_bit_for_bit() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    // ExPhil's 2-layer and 1-layer shapes, odd and wide layers, batch 1 and 8.
    for kind in [Kind::Gru, Kind::Lstm] {
        for (i, (hidden, embed, layers, b)) in [
            (256, 288, 2, 1),
            (256, 288, 1, 1),
            (200, 40, 2, 1),
            (512, 288, 2, 1),
            (45, 37, 3, 8),
            (256, 288, 2, 8),
        ]
        .into_iter()
        .enumerate()
        {
            let s = rnn_spec(kind, hidden, embed, layers);
            let (cpu, graph) = engines(&s, 90 + i as u64);
            let persist = CudaEngine::new(
                s.clone(),
                to_params(&random_params(&s, 90 + i as u64)),
                None,
            )
            .unwrap();
            assert!(
                graph.set_persistent_frames(false).unwrap(),
                "{kind:?}: no persistent kernel"
            );
            let x = Rng::new(91 + i as u64).vec_f32(7 * b * embed, 1.0, 0.0);
            let (mut sg, mut sp) = (graph.new_state(b).unwrap(), persist.new_state(b).unwrap());
            let (want, got) = (
                frames_out(&graph, &mut sg, &x, 40),
                frames_out(&persist, &mut sp, &x, 40),
            );
            let tag = format!("{kind:?} h{hidden} e{embed} l{layers} b{b}");
            assert_eq!(
                got, want,
                "{tag}: persistent frames differ from the graph's"
            );
            // Wider layers may need more blocks than the device keeps for persistent kernels
            // (then every frame is the graph's).
            if hidden <= 256 {
                assert!(
                    persist.persistent_counts().unwrap().0 > 0,
                    "{tag}: never persistent"
                );
            }
            // Against the CPU engine's window over the same 7 frames.
            let mut window = vec![0.0f32; b * 7 * embed];
            for t in 0..7 {
                for r in 0..b {
                    window[(r * 7 + t) * embed..(r * 7 + t + 1) * embed]
                        .copy_from_slice(&x[(t * b + r) * embed..(t * b + r + 1) * embed]);
                }
            }
            let err = rel_l2(&got[6], &cpu_predict(&cpu, &window, b, 7));
            assert!(err <= 1e-5, "{tag}: 7 frames vs cpu window, rel L2 {err}");
        }
    }
}

#[test]
fn gpu_persistent_kernel_stops_and_restarts_with_the_stream_intact() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    for kind in [Kind::Gru, Kind::Lstm] {
        let s = Spec {
            hidden: 48,
            embed: 37,
            ..spec(kind)
        };
        let params = || to_params(&random_params(&s, 5));
        let graph = CudaEngine::new(s.clone(), params(), None).unwrap();
        graph.set_persistent_frames(false).unwrap();
        let persist = CudaEngine::new(s.clone(), params(), None).unwrap();
        let x = Rng::new(6).vec_f32(7 * s.embed, 1.0, 0.0);
        let w = Rng::new(7).vec_f32(16 * s.embed, 1.0, 0.0);
        // The same calls on both engines: frames of two states in turn, pauses past the idle
        // time-out, a window, reset and init_state between frames.
        // The first frames on the graph path, then (persistent engine) its first launch from a
        // state that is not zero.
        let script = |e: &CudaEngine, persistent: bool| -> Vec<Vec<f32>> {
            let mut outs = Vec::new();
            let mut a = e.new_state(1).unwrap();
            e.set_persistent_frames(false).unwrap();
            outs.extend(frames_out(e, &mut a, &x, 3));
            e.set_persistent_frames(persistent).unwrap();
            outs.extend(frames_out(e, &mut a, &x, 5));
            std::thread::sleep(std::time::Duration::from_millis(40));
            outs.extend(frames_out(e, &mut a, &x, 3));
            let mut b = e.new_state(1).unwrap();
            outs.extend(frames_out(e, &mut b, &x, 2));
            outs.extend(frames_out(e, &mut a, &x, 2));
            outs.push(gpu_predict(e, &w, 1, 16));
            outs.extend(frames_out(e, &mut a, &x, 2));
            e.reset(&mut a).unwrap();
            outs.extend(frames_out(e, &mut a, &x, 3));
            std::thread::sleep(std::time::Duration::from_millis(12));
            outs.extend(frames_out(e, &mut b, &x, 3));
            drop(b);
            outs.extend(frames_out(e, &mut a, &x, 3));
            outs
        };
        let want = script(&graph, false);
        let got = script(&persist, true);
        assert_eq!(
            got, want,
            "{kind:?}: persistent stream differs from the graph's"
        );
        let (frames, launches) = persist.persistent_counts().unwrap();
        assert!(
            frames > 0 && launches >= 5,
            "{kind:?}: {frames} frames, {launches} launches"
        );
        // Dropped right after a frame (running) and while idle.
        let e = CudaEngine::new(s.clone(), params(), None).unwrap();
        let mut st = e.new_state(1).unwrap();
        frames_out(&e, &mut st, &x, 2);
        drop(st);
        drop(e);
        let e = CudaEngine::new(s.clone(), params(), None).unwrap();
        let mut st = e.new_state(1).unwrap();
        frames_out(&e, &mut st, &x, 2);
        std::thread::sleep(std::time::Duration::from_millis(30));
        drop(e);
        drop(st);
    }
}

#[test]
fn gpu_persistent_kernels_beyond_the_device_share_handed_over_after_the_idle_time_out() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    // 2 layers of 96 four-unit blocks at four per multiprocessor: 48 multiprocessors each, so
    // one kernel fits the device's half (66 on an H100) and two do not.
    let s = Spec {
        hidden: 384,
        embed: 40,
        ..spec(Kind::Gru)
    };
    let params = || to_params(&random_params(&s, 11));
    let reference = CudaEngine::new(s.clone(), params(), None).unwrap();
    reference.set_persistent_frames(false).unwrap();
    let (a, b) = (
        CudaEngine::new(s.clone(), params(), None).unwrap(),
        CudaEngine::new(s.clone(), params(), None).unwrap(),
    );
    let x = Rng::new(12).vec_f32(7 * s.embed, 1.0, 0.0);
    let (mut sr, mut sa, mut sb) = (
        reference.new_state(1).unwrap(),
        a.new_state(1).unwrap(),
        b.new_state(1).unwrap(),
    );
    let counts = |e: &CudaEngine| e.persistent_counts().unwrap().0;
    let mut want = Vec::new();
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let idle = std::time::Duration::from_millis(40);
    // a frames first and its kernel takes the room; b, framing in turn with it, replays its
    // graph. Both idle past the time-out; b frames first and takes a's share over, and a
    // (whose kernel has left) falls back to its graph while b keeps framing.
    for phase in 0..3 {
        let (a0, b0) = (counts(&a), counts(&b));
        for _ in 0..6 {
            want.extend(frames_out(&reference, &mut sr, &x, 1));
            if phase == 0 {
                got_a.extend(frames_out(&a, &mut sa, &x, 1));
                got_b.extend(frames_out(&b, &mut sb, &x, 1));
            } else {
                got_b.extend(frames_out(&b, &mut sb, &x, 1));
                got_a.extend(frames_out(&a, &mut sa, &x, 1));
            }
        }
        let (da, db) = (counts(&a) - a0, counts(&b) - b0);
        let expect = if phase == 0 { (6, 0) } else { (0, 6) };
        assert_eq!(
            (da, db),
            expect,
            "phase {phase}: frames on the kernel (a, b)"
        );
        if phase == 0 {
            std::thread::sleep(idle);
        }
    }
    assert_eq!(got_a, want, "engine a: frames differ from the graph's");
    assert_eq!(got_b, want, "engine b: frames differ from the graph's");
}

#[test]
fn gpu_an_engine_dropped_while_another_frames_on_its_kernel_does_not_wait_for_it() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    let s = Spec {
        hidden: 64,
        embed: 40,
        ..spec(Kind::Gru)
    };
    let framing = CudaEngine::new(s.clone(), to_params(&random_params(&s, 30)), None).unwrap();
    let mut st = framing.new_state(1).unwrap();
    let x = Rng::new(31).vec_f32(7 * s.embed, 1.0, 0.0);
    frames_out(&framing, &mut st, &x, 3);
    let span = std::time::Duration::from_millis(1500);
    // Engines made, used and dropped beside it (their staging and mailbox are page-locked
    // memory, whose free once waited for the framing kernel to leave).
    let (drops, frames_during) = beside_framing(&framing, &mut st, &x, span, || {
        (0..3)
            .map(|i| {
                let e = CudaEngine::new(s.clone(), to_params(&random_params(&s, 32 + i)), None)
                    .unwrap();
                let mut st = e.new_state(1).unwrap();
                frames_out(&e, &mut st, &x, 2);
                let t0 = std::time::Instant::now();
                drop(st);
                drop(e);
                t0.elapsed()
            })
            .collect::<Vec<_>>()
    });
    assert!(
        frames_during > 1000,
        "the framing engine ran {frames_during} frames on its kernel"
    );
    for (i, d) in drops.iter().enumerate() {
        assert!(
            *d < std::time::Duration::from_millis(100),
            "engine {i}'s drop took {d:?} while another engine framed"
        );
    }
}

#[test]
fn gpu_persistent_kernels_of_engines_that_fit_run_at_once() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    // Four 1-layer engines of 16 blocks each (and one LSTM among them): all of them fit the
    // device's half on any GPU with 32 multiprocessors or more.
    let specs = [Kind::Gru, Kind::Gru, Kind::Lstm, Kind::Gru].map(|kind| Spec {
        layers: 1,
        hidden: 64,
        embed: 40,
        ..spec(kind)
    });
    let made: Vec<_> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = to_params(&random_params(s, 20 + i as u64));
            let graph = CudaEngine::new(s.clone(), p.clone(), None).unwrap();
            graph.set_persistent_frames(false).unwrap();
            let persist = CudaEngine::new(s.clone(), p, None).unwrap();
            (graph, persist)
        })
        .collect();
    let mut states: Vec<_> = made
        .iter()
        .map(|(g, p)| (g.new_state(1).unwrap(), p.new_state(1).unwrap()))
        .collect();
    let x = Rng::new(21).vec_f32(specs[0].embed, 1.0, 0.0);
    let counts = |e: &CudaEngine| e.persistent_counts().unwrap();
    let mut before = Vec::new();
    // Frames of the four in turn (the first round launches their kernels): each kernel stays
    // running while the others frame, and every frame equals its graph's.
    for round in 0..9 {
        if round == 1 {
            before = made.iter().map(|(_, p)| counts(p)).collect();
        }
        for (i, ((g, p), (sg, sp))) in made.iter().zip(states.iter_mut()).enumerate() {
            let want = frames_out(g, sg, &x, 1);
            let got = frames_out(p, sp, &x, 1);
            assert_eq!(
                got, want,
                "engine {i}, round {round}: differs from its graph"
            );
        }
    }
    for (i, ((_, p), b)) in made.iter().zip(before).enumerate() {
        let (frames, launches) = counts(p);
        // (A launch may follow the full build of a kernel whose quick build served first.)
        assert!(
            frames - b.0 == 8 && launches - b.1 <= 1,
            "engine {i}: {} frames on its kernel, {} launches",
            frames - b.0,
            launches - b.1
        );
    }
}

#[test]
fn gpu_a_lone_engines_kernel_shrinks_to_make_room_for_a_second() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    // ExPhil's 2-layer hidden-256 GRU: 128 blocks, the general kernel's two per multiprocessor
    // take 64 multiprocessors (of the H100's half, 66), the batch-1 kernel's four 32: the first
    // engine's kernel starts general and shrinks when the second engine's does not fit beside it.
    let s = spec(Kind::Gru);
    let params = |seed| to_params(&random_params(&s, seed));
    let refs = [40, 41].map(|seed| {
        let e = CudaEngine::new(s.clone(), params(seed), None).unwrap();
        e.set_persistent_frames(false).unwrap();
        e
    });
    let engines = [40, 41].map(|seed| CudaEngine::new(s.clone(), params(seed), None).unwrap());
    let mut sr: Vec<_> = refs.iter().map(|e| e.new_state(1).unwrap()).collect();
    let mut se: Vec<_> = engines.iter().map(|e| e.new_state(1).unwrap()).collect();
    let x = Rng::new(42).vec_f32(7 * s.embed, 1.0, 0.0);
    let counts = |e: &CudaEngine| e.persistent_counts().unwrap();
    // The first alone for a few frames, then both in turn.
    for _ in 0..3 {
        let want = frames_out(&refs[0], &mut sr[0], &x, 1);
        assert_eq!(frames_out(&engines[0], &mut se[0], &x, 1), want, "alone");
    }
    let mut before = Vec::new();
    for round in 0..10 {
        if round == 4 {
            before = engines.iter().map(counts).collect();
        }
        for i in 0..2 {
            let want = frames_out(&refs[i], &mut sr[i], &x, 1);
            let got = frames_out(&engines[i], &mut se[i], &x, 1);
            assert_eq!(
                got, want,
                "engine {i}, round {round}: differs from its graph"
            );
        }
    }
    // Rounds 4-9: both on their kernels, without launching again.
    for (i, (e, b)) in engines.iter().zip(&before).enumerate() {
        let (frames, launches) = counts(e);
        assert!(
            frames - b.0 == 6 && launches == b.1,
            "engine {i}: {} frames on its kernel, {} launches in the last 6 rounds",
            frames - b.0,
            launches - b.1
        );
    }
    // The first launched again to shrink (a quick build's successor may add one to either).
    assert!(counts(&engines[0]).1 >= 2, "engine 0's launches");
}

#[test]
fn gpu_a_window_beside_another_engines_persistent_frames_does_not_wait_for_them() {
    let Some(_one) = gpu_alone() else {
        return;
    };
    // ExPhil's GRU: its window's thread-block clusters (sm_90+) do not fit beside a running
    // persistent kernel, which runs for as long as its engine frames.
    let s = spec(Kind::Gru);
    let framing = CudaEngine::new(s.clone(), to_params(&random_params(&s, 50)), None).unwrap();
    let windowing = CudaEngine::new(s.clone(), to_params(&random_params(&s, 51)), None).unwrap();
    let mut st = framing.new_state(1).unwrap();
    let x = Rng::new(52).vec_f32(7 * s.embed, 1.0, 0.0);
    let xw = Rng::new(53).vec_f32(s.window * s.embed, 1.0, 0.0);
    let mut yw = vec![f32::NAN; s.hidden];
    windowing.predict(1, s.window, &xw, &mut yw).unwrap();
    let want = yw.clone();
    frames_out(&framing, &mut st, &x, 3);
    let span = std::time::Duration::from_millis(1500);
    let (windows, kernel_frames) = beside_framing(&framing, &mut st, &x, span, || {
        (0..5)
            .map(|_| {
                let t0 = std::time::Instant::now();
                yw.fill(f32::NAN);
                windowing.predict(1, s.window, &xw, &mut yw).unwrap();
                assert_eq!(yw, want, "the window's output");
                t0.elapsed()
            })
            .collect::<Vec<_>>()
    });
    for (i, d) in windows.iter().enumerate() {
        assert!(
            *d < std::time::Duration::from_millis(100),
            "window {i} took {d:?} beside the framing engine"
        );
    }
    // The framing engine had its kernel before the windows and gets it back after them.
    assert!(kernel_frames > 100, "{kernel_frames} frames on the kernel");
    std::thread::sleep(std::time::Duration::from_millis(30));
    let (before, _) = framing.persistent_counts().unwrap();
    frames_out(&framing, &mut st, &x, 10);
    assert_eq!(
        framing.persistent_counts().unwrap().0 - before,
        10,
        "frames on the kernel after the windows"
    );
}

#[test]
fn gpu_an_rnn_op_beside_an_engines_persistent_frames_does_not_wait_for_them() {
    use fused_kernels_core::dtype::DType;
    use fused_kernels_core::ops::rnn::Cell;
    use fused_kernels_core::ops::Backend;
    use support::rnn::{case, check};
    let Some(_one) = gpu_alone() else {
        return;
    };
    let s = spec(Kind::Gru);
    let framing = CudaEngine::new(s.clone(), to_params(&random_params(&s, 60)), None).unwrap();
    let mut st = framing.new_state(1).unwrap();
    let x = Rng::new(61).vec_f32(7 * s.embed, 1.0, 0.0);
    frames_out(&framing, &mut st, &x, 3);
    // ExPhil's 2-layer GRU as a batch-1 op call (thread-block clusters on sm_90+).
    let c = case(Cell::Gru, 1, 60, 288, &[256, 256], false, false, DType::F32);
    check(Backend::Cuda(None), &c, 62);
    let span = std::time::Duration::from_secs(3);
    // (`check` asserts the outputs against an f64 reference.)
    let (calls, _) = beside_framing(&framing, &mut st, &x, span, || {
        (0..3)
            .map(|i| {
                let t0 = std::time::Instant::now();
                check(Backend::Cuda(None), &c, 63 + i);
                t0.elapsed()
            })
            .collect::<Vec<_>>()
    });
    for (i, d) in calls.iter().enumerate() {
        // The call's f64 reference runs on the host too; waiting out the framing would take
        // the rest of `span`.
        assert!(
            *d < std::time::Duration::from_secs(1),
            "op call {i} took {d:?} beside the framing engine"
        );
    }
}
