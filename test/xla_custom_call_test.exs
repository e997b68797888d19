# Compiled only where EXLA's `EXLA.CustomCall` protocol (EXLA ≥ 0.12) and Axon are loaded;
# tagged :exla, excluded elsewhere (see test_helper.exs).
if Code.ensure_loaded?(EXLA.CustomCall) and Code.ensure_loaded?(Axon) do
  Code.require_file("support/xla_blocks.exs", __DIR__)

  defmodule FusedKernels.XLACustomCallTest do
    # The custom calls the fused Axon layers emit under EXLA: the Nx.block node, the spec our
    # EXLA.CustomCall implementation answers (target, attributes, operand types), :skip where
    # the handlers do not serve the call, and values and gradients through the block's
    # default (pure-Nx) body, which is what runs wherever the spec is skipped.
    use ExUnit.Case, async: true
    @moduletag :exla

    alias EXLA.CustomCall.Spec
    alias FusedKernels.Axon.{Call, Layers, Ops}
    alias FusedKernels.XLA
    alias FusedKernels.XLA.Block
    alias FusedKernels.XLA.Lowering

    @cuda struct(EXLA.Client, platform: :cuda)
    @host struct(EXLA.Client, platform: :host)

    import FusedKernels.XLABlocks

    defp gru_inputs(b, t, f, h) do
      ik = Map.new(~w(wir wiz win), &{&1, rand({f, h})})
      hk = Map.new(~w(whr whz whn), &{&1, rand({h, h})})
      bias = Map.new(~w(br bz bin bhn), &{&1, rand({h})})
      {rand({b, t, f}), rand({b, h}), ik, hk, bias}
    end

    test "the path is :exla when EXLA.CustomCall is loaded and the handlers registered" do
      assert XLA.available?()
      assert Call.path([]) == :exla
      assert Call.path(backend: :cpu) != :exla
    end

    test "the GRU layer emits one fused_kernels_gru block with Axon's parameters in the handler's order" do
      {x, h, ik, hk, bias} = gru_inputs(1, 6, 5, 4)

      fun = fn x, h, ik, hk, bias -> Layers.gru(x, {h}, 0, ik, hk, bias, []) end
      assert [{:ok, %Spec{} = spec}] = specs(fun, [x, h, ik, hk, bias], @cuda)
      assert spec.call_target_name == "fused_kernels_gru"
      assert spec.attributes == [{"initial_state", "true"}, {"layers", "1 : i64"}]
      assert spec.operand_element_types == List.duplicate({:f, 32}, 12)

      # (Expressions are never matched or compared whole: a failure would print the graph.)
      found = blocks(apply(Nx.Defn.debug_expr(fun), [x, h, ik, hk, bias]))
      assert length(found) == 1
      [{block, in_args, out}] = found
      assert block.target == "fused_kernels_gru"
      # x, wir, wiz, win, whr, whz, whn, br, bz, bin, bhn, h
      assert Enum.map(in_args, &Nx.shape/1) ==
               [{1, 6, 5}] ++
                 List.duplicate({5, 4}, 3) ++
                 List.duplicate({4, 4}, 3) ++
                 List.duplicate({4}, 4) ++ [{1, 4}]

      # Results: the sequence, then h, then the handler's f32 workspace (what the layer
      # returns is only the sequence and h).
      words = Lowering.rnn_workspace_words(:gru, 4, 1, 6, 5, [4])
      assert block.extra == [{{words}, {:f, 32}}]
      assert out |> Tuple.to_list() |> Enum.map(&Nx.shape/1) == [{1, 6, 4}, {1, 4}, {words}]
      assert out |> Tuple.to_list() |> List.last() |> Nx.type() == {:f, 32}
      {seq, {hn}} = apply(Nx.Defn.debug_expr(fun), [x, h, ik, hk, bias])
      assert {Nx.shape(seq), Nx.shape(hn)} == {{1, 6, 4}, {1, 4}}
    end

    test "workspace lengths equal the handlers' (the Rust tests pin the same numbers)" do
      # The users' GRU and LSTM (2 x 256, window 60, batch 1, 288 features), f32 and bf16.
      assert Lowering.rnn_workspace_words(:gru, 4, 1, 60, 288, [256, 256]) == 3_030_976
      assert Lowering.rnn_workspace_words(:lstm, 4, 1, 60, 288, [256, 256]) == 3_681_216
      assert Lowering.rnn_workspace_words(:gru, 2, 1, 60, 288, [256, 256]) == 2_609_856
      assert Lowering.mamba_workspace_words(2, 61, 64, 128, 16, 4) == 1_162_496

      # At least the f32 projection, the sequence and the packed kernels; growing with the
      # sizes.
      {b, t, f, h} = {8, 100, 200, 512}
      gru = Lowering.rnn_workspace_words(:gru, 4, b, t, f, [h])
      assert gru >= b * t * 3 * h + b * t * h + f * 3 * h + h * 3 * h
      assert Lowering.rnn_workspace_words(:gru, 4, b, t + 1, f, [h]) > gru
      assert Lowering.rnn_workspace_words(:lstm, 4, b, t, f, [h]) > gru

      # The LSTM layer's block declares its workspace too.
      {x, c, hh} = {rand({2, 3, 5}), rand({2, 4}), rand({2, 4})}
      ik = Map.new(~w(wii wif wig wio), &{&1, rand({5, 4})})
      hk = Map.new(~w(whi whf whg who), &{&1, rand({4, 4})})
      bias = Map.new(~w(bi bf bg bo), &{&1, rand({4})})
      fun = fn x, c, hh, ik, hk, bias -> Layers.lstm(x, {c, hh}, 0, ik, hk, bias, []) end
      [{block, in_args, out}] = blocks(apply(Nx.Defn.debug_expr(fun), [x, c, hh, ik, hk, bias]))
      assert block.target == "fused_kernels_lstm"
      words = Lowering.rnn_workspace_words(:lstm, 4, 2, 3, 5, [4])

      assert out |> Tuple.to_list() |> Enum.map(&Nx.shape/1) == [
               {2, 3, 4},
               {2, 4},
               {2, 4},
               {words}
             ]

      assert {:ok, %Spec{call_target_name: "fused_kernels_lstm"}} =
               EXLA.CustomCall.call(block, out, in_args, @cuda)
    end

    test "the host client is skipped; f64 is not lowered" do
      {x, h, ik, hk, bias} = gru_inputs(1, 3, 2, 2)
      fun = fn x, h, ik, hk, bias -> Layers.gru(x, {h}, 0, ik, hk, bias, []) end
      assert specs(fun, [x, h, ik, hk, bias], @host) == [:skip]

      # f64 is not lowered at all: no block, the op's next path.
      f64 = fn t -> Nx.as_type(t, :f64) end
      args64 = Enum.map([x, h, ik, hk, bias], &Nx.Defn.Composite.traverse(&1, f64))
      assert specs(fun, args64, @cuda) == []

      dense = fn x, k -> Call.run(Ops.Dense, {%{x: x, kernel: k}}, activation: :gelu) end
      assert [{:ok, _}] = specs(dense, [rand({3, 4}), rand({4, 5})], @cuda)
      assert specs(dense, [rand({3, 4}, :f64), rand({4, 5}, :f64)], @cuda) == []
    end

    test "a block whose operand or result types changed since it was planned is skipped" do
      block = %Block{
        target: "fused_kernels_layer_norm",
        operand_types: [{:f, 32}, {:f, 32}, {:f, 32}],
        result_types: [{:f, 32}]
      }

      args = [Nx.template({2, 8}, :f32), Nx.template({8}, :f32), Nx.template({8}, :f32)]
      assert {:ok, %Spec{}} = XLA.spec(block, {Nx.template({2, 8}, :f32)}, args, @cuda)
      assert XLA.spec(block, {Nx.template({2, 8}, :bf16)}, args, @cuda) == :skip
      assert XLA.spec(block, {Nx.template({2, 8}, :f32)}, tl(args), @cuda) == :skip
    end

    test "LayerNorm, dense and the attention layer's parts: targets and attributes" do
      ln = fn x, g, b -> Call.run(Ops.LayerNorm, {x, g, b}, epsilon: 1.0e-6) end

      assert [{:ok, %Spec{call_target_name: "fused_kernels_layer_norm"} = s}] =
               specs(ln, [rand({3, 8}, :bf16), rand({8}), rand({8})], @cuda)

      assert s.attributes == [{"eps", "1.0e-6 : f64"}, {"operands", "\"x,gamma,beta\""}]
      # bf16 rows, f32 gamma and beta (what the kernel takes).
      assert s.operand_element_types == [{:bf, 16}, {:f, 32}, {:f, 32}]

      dense = fn x, k, b, r ->
        Call.run(Ops.Dense, {%{x: x, kernel: k, bias: b, residual: r}}, activation: :gelu)
      end

      assert [{:ok, d}] =
               specs(dense, [rand({2, 3, 4}), rand({4, 5}), rand({5}), rand({2, 3, 5})], @cuda)

      assert d.call_target_name == "fused_kernels_dense"

      assert d.attributes == [
               {"activation", "\"gelu\""},
               {"kind", "\"dense\""},
               {"operands", "\"x,kernel,bias,residual\""}
             ]

      # The attention layer: q, k, v projections, the attention, the output projection.
      params = %{
        "q" => %{"kernel" => rand({8, 8}), "bias" => rand({8})},
        "k" => %{"kernel" => rand({8, 8}), "bias" => rand({8})},
        "v" => %{"kernel" => rand({8, 8}), "bias" => rand({8})},
        "out" => %{"kernel" => rand({8, 8}), "bias" => rand({8})}
      }

      attn = fn x, p -> Call.run(Ops.Attention, {x, p}, heads: 2, causal: true) end
      got = specs(attn, [rand({1, 5, 8}), params], @cuda)
      targets = Enum.map(got, fn {:ok, s} -> s.call_target_name end)

      assert Enum.sort(targets) ==
               Enum.sort(
                 List.duplicate("fused_kernels_dense", 4) ++ ["fused_kernels_flash_attention"]
               )

      {:ok, fa} = Enum.find(got, fn {:ok, s} -> s.call_target_name =~ "attention" end)

      assert fa.attributes == [
               {"causal", "true"},
               {"layout", "\"bshd\""},
               {"window_left", "-1 : i64"},
               {"window_right", "-1 : i64"}
             ]
    end

    test "the Mamba block passes Edifice's fixed A and skips the mean-dt discretisation" do
      {h, inner, state, rank} = {4, 6, 3, 2}

      params = mamba_params("mb", h, inner, state, rank, false)

      run = fn opts -> fn x, p -> Call.run(Ops.MambaBlock, {x, p}, [name: "mb"] ++ opts) end end
      [{:ok, s}] = specs(run.([]), [rand({1, 5, h}), params], @cuda)
      assert s.call_target_name == "fused_kernels_mamba_block"

      assert {"operands",
              "\"x,norm_gamma,norm_beta,in_kernel,in_bias,conv_kernel,conv_bias,bc_kernel,dt_rank_kernel,dt_proj_kernel,dt_proj_bias,a,out_kernel\""} in s.attributes

      assert {"residual", "true"} in s.attributes
      assert length(s.operand_element_types) == 13

      # out (x's shape), then the workspace.
      [{block, _in, out}] = blocks(apply(Nx.Defn.debug_expr(run.([])), [rand({1, 5, h}), params]))
      words = Lowering.mamba_workspace_words(1, 5, h, inner, state, rank)
      assert block.extra == [{{words}, {:f, 32}}]
      assert out |> Tuple.to_list() |> Enum.map(&Nx.shape/1) == [{1, 5, h}, {words}]
      assert specs(run.(b_discretization: :mean_dt), [rand({1, 5, h}), params], @cuda) == []
    end

    test "values and gradients through the blocks' default bodies equal the pure-Nx op" do
      {x, h, ik, hk, bias} = gru_inputs(2, 5, 3, 4)
      w = rand({2, 5, 4})

      fused = fn x, h, ik, hk, bias ->
        {seq, {hn}} = Layers.gru(x, {h}, 0, ik, hk, bias, [])
        {seq, hn}
      end

      plain = fn x, h, ik, hk, bias ->
        {seq, {hn}} = Axon.Layers.gru(x, {h}, 0, ik, hk, bias, unroll: :static)
        {seq, hn}
      end

      jit = &Nx.Defn.jit(&1, compiler: Nx.Defn.Evaluator)
      args = [x, h, ik, hk, bias]
      {s1, h1} = apply(jit.(fused), args)
      {s2, h2} = apply(jit.(plain), args)
      assert Nx.all_close(s1, s2, atol: 1.0e-6) |> Nx.to_number() == 1
      assert Nx.all_close(h1, h2, atol: 1.0e-6) |> Nx.to_number() == 1

      loss = fn f ->
        fn x, h, ik, hk, bias ->
          Nx.Defn.grad({x, ik}, fn {x, ik} ->
            {seq, _} = f.(x, h, ik, hk, bias)
            seq |> Nx.multiply(w) |> Nx.sum()
          end)
        end
      end

      {gx1, gk1} = apply(jit.(loss.(fused)), args)
      {gx2, gk2} = apply(jit.(loss.(plain)), args)
      assert Nx.all_close(gx1, gx2, atol: 1.0e-5) |> Nx.to_number() == 1

      for key <- Map.keys(gk2),
          do: assert(Nx.all_close(gk1[key], gk2[key], atol: 1.0e-5) |> Nx.to_number() == 1)
    end

    test "MLIR attribute text" do
      assert XLA.attr_bool(false) == "false"
      assert XLA.attr_int(-1) == "-1 : i64"
      assert XLA.attr_float(0.001) == "0.001 : f64"
      assert XLA.attr_float(2) == "2.0 : f64"
      assert XLA.attr_string(~s(a"b)) == ~s("a\\"b")
    end
  end

  defmodule FusedKernels.XLAUnregisteredTest do
    # Without the handlers registered no custom call is emitted (EXLA would fail to compile
    # one). Not async: it withdraws the process-wide registration for its duration.
    use ExUnit.Case, async: false
    @moduletag :exla

    import FusedKernels.XLABlocks

    test "no blocks until the handlers are registered" do
      fun = &FusedKernels.rms_norm(&1, &2)
      args = [rand({2, 8}), rand({8})]
      assert [_] = traced(fun, args)
      FusedKernels.XLA.registered(false)

      try do
        refute FusedKernels.XLA.available?()
        assert FusedKernels.Axon.Call.path([]) != :exla
        assert traced(fun, args) == []
      after
        FusedKernels.XLA.registered(true)
      end

      assert [_] = traced(fun, args)
      assert FusedKernels.XLA.load("/nonexistent/libfused_kernels_xla.so") |> elem(0) == :error
    end
  end
end
