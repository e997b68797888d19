# Compiled only where EXLA's `EXLA.CustomCall` protocol (EXLA ≥ 0.12) and Axon are loaded;
# tagged :exla, excluded elsewhere (see test_helper.exs).
if Code.ensure_loaded?(EXLA.CustomCall) and Code.ensure_loaded?(Axon) do
  Code.require_file("support/xla_blocks.exs", __DIR__)

  defmodule FusedKernels.XLAOpsTest do
    # The top-level fused ops inside defn under EXLA: one custom-call block each, with the
    # targets, attributes and operand types the handlers decode (read from the handlers'
    # source, native/fused_kernels_xla/src), :skip or no block where a call is not served,
    # and values and gradients through the blocks' default (pure-Nx) bodies.
    use ExUnit.Case, async: true
    @moduletag :exla

    import FusedKernels.XLABlocks
    alias EXLA.CustomCall.Spec
    alias FusedKernels.Axon.Layers

    @cuda struct(EXLA.Client, platform: :cuda)
    @host struct(EXLA.Client, platform: :host)
    @src Path.expand("../native/fused_kernels_xla/src", __DIR__)

    ## The handlers' contract, from their source

    # target => %{attributes: [names], section: the ops.rs text of its op}
    defp handler_table do
      lib = File.read!(Path.join(@src, "lib.rs"))
      ops = File.read!(Path.join(@src, "ops.rs"))
      exported = Regex.scan(~r/(fused_kernels_\w+) => ops::(\w+)/, lib)
      assert length(exported) == 8, "the handlers! table in lib.rs was not found"
      sections = String.split(ops, ~r/^\/\/ -{20,}$/m)

      Map.new(exported, fn [_, target, const] ->
        spec =
          ~r/pub const #{const}: OpSpec = OpSpec \{\s*name: "([^"]+)",\s*attributes: &\[([^\]]*)\]/s

        [_, name, list] = Regex.run(spec, ops) || flunk("OpSpec #{const} not found in ops.rs")
        assert name == target
        attributes = Regex.scan(~r/"(\w+)"/, list) |> Enum.map(&Enum.at(&1, 1))
        section = Enum.find(sections, &String.contains?(&1, ~s(name: "#{target}")))
        {target, %{attributes: attributes, section: section}}
      end)
    end

    # attribute name => :bool | :int | :float | :str, from the `Attrs` getters that read it.
    defp attribute_kinds do
      ops = File.read!(Path.join(@src, "ops.rs"))

      Regex.scan(~r/\.(bool|int|float|str)_or\(\s*"(\w+)"/, ops)
      |> Enum.group_by(fn [_, _, name] -> name end, fn [_, kind, _] -> String.to_atom(kind) end)
      |> Map.new(fn {name, kinds} ->
        assert length(Enum.uniq(kinds)) == 1, "#{name} is read as #{inspect(kinds)}"
        {name, hd(kinds)}
      end)
    end

    # The kind of an MLIR attribute text (FusedKernels.XLA.attr_*).
    defp text_kind(text) do
      cond do
        text in ["true", "false"] -> :bool
        text =~ ~r/^-?\d+ : i64$/ -> :int
        text =~ ~r/ : f64$/ -> :float
        text =~ ~r/^".*"$/ -> :str
      end
    end

    # One traced call of every op the handlers serve, through the public entry points.
    defp every_op do
      {b, s, f, h} = {2, 5, 3, 4}
      x = rand({b, s, f})
      gamma = rand({f})

      axon = fn cell ->
        p = rnn_params(cell, f, h)
        [p["input_kernel"], p["hidden_kernel"], p["bias"]]
      end

      gru = fn ->
        fun = fn x, h0, ik, hk, bias -> Layers.gru(x, {h0}, 0, ik, hk, bias, []) end
        {fun, [x, rand({b, h}) | axon.(:gru)]}
      end

      lstm = fn ->
        fun = fn x, c, h0, ik, hk, bias -> Layers.lstm(x, {c, h0}, 0, ik, hk, bias, []) end
        {fun, [x, rand({b, h}), rand({b, h}) | axon.(:lstm)]}
      end

      [
        gru.(),
        lstm.(),
        {&FusedKernels.layer_norm(&1, &2, &3, eps: 1.0e-6, residual: &4),
         [x, gamma, rand({f}), rand({b, s, f})]},
        {&FusedKernels.rms_norm(&1, &2), [x, gamma]},
        {&FusedKernels.dense(&1, &2, &3, activation: :gelu_tanh, residual: &4),
         [x, rand({f, h}), rand({h}), rand({b, s, h})]},
        {&FusedKernels.swiglu(&1, &2, &3, bias_up: &4),
         [x, rand({f, h}), rand({f, h}), rand({h})]},
        {&FusedKernels.rms_norm_dense(&1, &2, &3, eps: 1.0e-5), [x, gamma, rand({f, h})]},
        {&FusedKernels.layer_norm_dense(&1, &2, &3, &4, activation: :silu),
         [x, gamma, rand({f}), rand({f, h})]},
        {&FusedKernels.flash_attention(&1, &2, &3, causal: true, scale: 0.3, window: {2, 0}),
         [rand({1, 6, 2, 8}), rand({1, 6, 2, 8}), rand({1, 6, 2, 8})]},
        scan_call(
          delta_softplus: true,
          return_last_state: true,
          d: rand({6}),
          z: rand({2, 7, 6}),
          delta_bias: rand({6}),
          initial_state: rand({2, 6, 3})
        ),
        mamba_call()
      ]
    end

    # {fun of extra options, args}: a selective scan with the optional tensors of `opts`
    # passed as a map argument.
    defp scan_case(opts, type \\ :f32, state \\ 3) do
      {b, l, d} = {2, 7, 6}
      {tensors, opts} = Keyword.split(opts, [:d, :z, :delta_bias, :initial_state])
      a = Nx.negate(Nx.abs(rand({d, state})))
      base = [rand({b, l, d}, type), rand({b, l, d}, type), a]
      base = base ++ [rand({b, l, state}, type), rand({b, l, state}, type)]
      scan = &FusedKernels.selective_scan/6

      if tensors == [] do
        {fn more -> fn u, dt, a, bb, c -> scan.(u, dt, a, bb, c, opts ++ more) end end, base}
      else
        {fn more ->
           fn u, dt, a, bb, c, t -> scan.(u, dt, a, bb, c, opts ++ more ++ Map.to_list(t)) end
         end, base ++ [Map.new(tensors)]}
      end
    end

    defp scan_call(opts, type \\ :f32, state \\ 3) do
      {make, args} = scan_case(opts, type, state)
      {make.([]), args}
    end

    defp mamba_call do
      {&FusedKernels.mamba_block(&1, &2, name: "mb", dt_max: 0.2),
       [rand({1, 5, 4}), mamba_params("mb", 4, 6, 3, 2)]}
    end

    test "every target, attribute and operand name the lowering emits is one the handlers decode" do
      table = handler_table()
      kinds = attribute_kinds()

      emitted =
        for {fun, args} <- every_op(), {struct, in_args, out} <- traced(fun, args) do
          assert {:ok, %Spec{} = spec} = EXLA.CustomCall.call(struct, out, in_args, @cuda)
          target = spec.call_target_name
          assert %{attributes: allowed, section: section} = table[target], "unknown #{target}"
          assert length(spec.operand_element_types) == length(in_args)

          for {name, text} <- spec.attributes do
            assert name in allowed, "#{target} does not take the attribute #{name}"

            assert text_kind(text) == kinds[name],
                   "#{target}.#{name} = #{text}: the handler reads it with #{kinds[name]}_or"
          end

          # Every operand name in `operands` is one the target's code names.
          with {_, names} <- List.keyfind(spec.attributes, "operands", 0) do
            for n <- names |> String.trim("\"") |> String.split(","),
                do: assert(section =~ ~s("#{n}"), "#{target} has no operand #{n}")
          end

          target
        end

      assert Enum.sort(Enum.uniq(emitted)) == Enum.sort(Map.keys(table))
    end

    test "norms: targets, operands in the handler's names and types, the residual's sum" do
      x = rand({3, 5, 8}, :bf16)
      g = rand({8})

      [{:ok, s}] = specs(&FusedKernels.layer_norm(&1, &2, nil, eps: 1.0e-4), [x, g], @cuda)
      assert s.call_target_name == "fused_kernels_layer_norm"
      # Without beta the call passes zeros (what the kernel adds for a missing beta).
      assert s.attributes == [{"eps", "0.0001 : f64"}, {"operands", ~s("x,gamma,beta")}]
      assert s.operand_element_types == [{:bf, 16}, {:f, 32}, {:f, 32}]

      rms = &FusedKernels.rms_norm(&1, &2, eps: 1.0e-6, residual: &3)
      [{block, in_args, out}] = traced(rms, [x, g, rand({3, 5, 8}, :bf16)])
      {:ok, s} = EXLA.CustomCall.call(block, out, in_args, @cuda)
      assert s.call_target_name == "fused_kernels_rms_norm"
      assert {"operands", ~s("x,weight,residual")} in s.attributes
      assert s.operand_element_types == [{:bf, 16}, {:f, 32}, {:bf, 16}]
      # out and sum, both in x's type.
      assert out |> Tuple.to_list() |> Enum.map(&{&1.shape, &1.type}) ==
               List.duplicate({{3, 5, 8}, {:bf, 16}}, 2)

      assert EXLA.CustomCall.call(block, out, in_args, @host) == :skip
      # Not lowered: f64, and an explicit backend: :nx.
      assert traced(&FusedKernels.rms_norm(&1, &2), [rand({2, 8}, :f64), rand({8}, :f64)]) == []
      assert traced(&FusedKernels.rms_norm(&1, &2, backend: :nx), [rand({2, 8}), g]) == []
    end

    test "dense kinds: the norm-fused kinds return their row statistics after the output" do
      x = rand({2, 3, 8})
      ln = &FusedKernels.layer_norm_dense(&1, &2, &3, &4, eps: 1.0e-5, bias: &5)
      args = [x, rand({8}), rand({8}), rand({8, 5}), rand({5})]
      [{block, in_args, out}] = traced(ln, args)
      assert block.extra == [{{6, 2}, {:f, 32}}]
      assert out |> Tuple.to_list() |> Enum.map(& &1.shape) == [{2, 3, 5}, {6, 2}]
      {:ok, s} = EXLA.CustomCall.call(block, out, in_args, @cuda)

      assert s.attributes == [
               {"activation", ~s("none")},
               {"eps", "1.0e-5 : f64"},
               {"kind", ~s("layer_norm_dense")},
               {"operands", ~s("x,kernel,bias,gamma,beta")}
             ]

      sw = &FusedKernels.swiglu(&1, &2, &3, bias_gate: &4)

      [{:ok, s}] =
        specs(sw, [rand({4, 8}, :f16), rand({8, 5}, :f16), rand({8, 5}), rand({5})], @cuda)

      assert {"operands", ~s("x,kernel,kernel_up,bias")} in s.attributes
      assert {"kind", ~s("swiglu")} in s.attributes
      # Every operand in x's type (the kernels' rule); the f32 ones are converted.
      assert s.operand_element_types == List.duplicate({:f, 16}, 4)

      # A 1-D x is left to the pure-Nx path.
      assert traced(&FusedKernels.dense(&1, &2), [rand({8}), rand({8, 5})]) == []
    end

    test "selective scan: u's type for the sequences, f32 for a and the state; mean-dt is not lowered" do
      {fun, args} = scan_call([delta_softplus: true, d: rand({6})], :bf16)
      [{block, in_args, out}] = traced(fun, args)
      {:ok, s} = EXLA.CustomCall.call(block, out, in_args, @cuda)
      assert s.call_target_name == "fused_kernels_selective_scan"
      assert s.attributes == [{"delta_softplus", "true"}, {"operands", ~s("u,delta,a,b,c,d")}]

      assert s.operand_element_types == [
               {:bf, 16},
               {:bf, 16},
               {:f, 32},
               {:bf, 16},
               {:bf, 16},
               {:f, 32}
             ]

      assert out |> Tuple.to_list() |> Enum.map(&{&1.shape, &1.type}) == [{{2, 7, 6}, {:bf, 16}}]

      {fun, args} = scan_call(return_last_state: true, initial_state: rand({2, 6, 3}))
      [{_block, _in, out}] = traced(fun, args)

      assert out |> Tuple.to_list() |> Enum.map(&{&1.shape, &1.type}) ==
               [{{2, 7, 6}, {:f, 32}}, {{2, 6, 3}, {:f, 32}}]

      {fun, args} = scan_call(b_discretization: :mean_dt)
      assert traced(fun, args) == []
      {fun, args} = scan_call([], :f32, 300)
      assert_raise ArgumentError, ~r/state size 300/, fn -> traced(fun, args) end
    end

    test "LSTM/GRU stacks: one call per stack, zeros for a layer without a state" do
      {b, t, f} = {2, 6, 3}
      params = [rnn_params(:lstm, f, 5), rnn_params(:lstm, 5, 4)]
      state = {rand({b, 5}), rand({b, 5})}

      fun = fn x, p, s ->
        {seq, states} = FusedKernels.lstm_stack(x, p, initial_state: [s, nil], reverse: true)
        {seq, List.to_tuple(states)}
      end

      [{block, in_args, out}] = traced(fun, [rand({b, t, f}), params, state])
      {:ok, s} = EXLA.CustomCall.call(block, out, in_args, @cuda)
      assert s.call_target_name == "fused_kernels_lstm"

      assert s.attributes == [
               {"initial_state", "true"},
               {"layers", "2 : i64"},
               {"reverse", "true"}
             ]

      # x, then per layer 4 input kernels, 4 hidden kernels, 4 biases, c and h.
      assert Enum.map(in_args, & &1.shape) ==
               [{b, t, f}] ++
                 List.duplicate({f, 5}, 4) ++
                 List.duplicate({5, 5}, 4) ++
                 List.duplicate({5}, 4) ++
                 [{b, 5}, {b, 5}] ++
                 List.duplicate({5, 4}, 4) ++
                 List.duplicate({4, 4}, 4) ++ List.duplicate({4}, 4) ++ [{b, 4}, {b, 4}]

      words = FusedKernels.XLA.Lowering.rnn_workspace_words(:lstm, 4, b, t, f, [5, 4])

      assert out |> Tuple.to_list() |> Enum.map(& &1.shape) ==
               [{b, t, 4}, {b, 5}, {b, 5}, {b, 4}, {b, 4}, {words}]

      # Up to 128 operands in one call (an LSTM of 9 layers with states: 127); more take
      # the pure-Nx path.
      deep = fn layers ->
        fun = fn x, p, s ->
          {seq, states} = FusedKernels.lstm_stack(x, p, initial_state: Tuple.to_list(s))
          {seq, List.to_tuple(states)}
        end

        args = [
          rand({1, 2, 3}),
          List.duplicate(rnn_params(:lstm, 3, 3), layers),
          List.to_tuple(List.duplicate({rand({1, 3}), rand({1, 3})}, layers))
        ]

        traced(fun, args) |> Enum.map(fn {_, in_args, _} -> length(in_args) end)
      end

      assert deep.(9) == [127]
      assert deep.(10) == []

      # Without states: initial_state false and no state operands.
      gru = &FusedKernels.gru(&1, &2)
      [{:ok, s}] = specs(gru, [rand({b, t, f}, :bf16), rnn_params(:gru, f, 4)], @cuda)
      assert {"initial_state", "false"} in s.attributes
      assert s.operand_element_types == List.duplicate({:bf, 16}, 11)
    end

    test "attention: out and lse from one call" do
      q = rand({1, 5, 2, 16}, :bf16)
      fa = &FusedKernels.flash_attention(&1, &2, &3, layout: :bshd, return_lse: true)
      {out, lse} = apply(Nx.Defn.debug_expr(fa), [q, q, q])

      assert {out.shape, out.type, lse.shape, lse.type} ==
               {{1, 5, 2, 16}, {:bf, 16}, {1, 2, 5}, {:f, 32}}

      [{:ok, s}] = specs(fa, [q, q, q], @cuda)
      assert s.call_target_name == "fused_kernels_flash_attention"
      refute List.keymember?(s.attributes, "scale", 0)

      # Over the kernel's limit the call fails while tracing, as on every backend.
      big = rand({1, 2, 1, 320})

      assert_raise ArgumentError, ~r/head_dim 320 is over/, fn ->
        traced(&FusedKernels.flash_attention(&1, &2, &3), [big, big, big])
      end
    end

    test "values and gradients through the default bodies equal the pure-Nx ops" do
      jit = &Nx.Defn.jit(&1, compiler: Nx.Defn.Evaluator)

      # {fun of extra options, args}; `backend: :nx` gives the same call without a block.
      cases = [
        {fn more ->
           fn x, g, b, r -> FusedKernels.layer_norm(x, g, b, [residual: r] ++ more) end
         end, [rand({3, 8}), rand({8}), rand({8}), rand({3, 8})]},
        {fn more ->
           fn x, g, k -> FusedKernels.rms_norm_dense(x, g, k, [activation: :gelu] ++ more) end
         end, [rand({2, 3, 8}), rand({8}), rand({8, 5})]},
        scan_case(
          delta_softplus: true,
          return_last_state: true,
          d: rand({6}),
          z: rand({2, 7, 6})
        ),
        {fn more -> &FusedKernels.flash_attention(&1, &2, &3, [causal: true] ++ more) end,
         [rand({1, 5, 2, 8}), rand({1, 5, 2, 8}), rand({1, 5, 2, 8})]},
        {fn more ->
           fn x, p, h ->
             {seq, states} = FusedKernels.gru_stack(x, p, [initial_state: [nil, {h}]] ++ more)
             {seq, List.to_tuple(states)}
           end
         end, [rand({2, 4, 3}), [rnn_params(:gru, 3, 5), rnn_params(:gru, 5, 4)], rand({2, 4})]}
      ]

      for {make, args} <- cases do
        {fused, plain} = {make.([]), make.(backend: :nx)}
        assert traced(fused, args) != []
        assert traced(plain, args) == []

        for {a, b} <- Enum.zip(flat(apply(jit.(fused), args)), flat(apply(jit.(plain), args))),
            do: assert(Nx.all_close(a, b, atol: 1.0e-5) |> Nx.to_number() == 1)

        # d/d(first input) of a smooth function of every output.
        loss = fn f ->
          fn x ->
            Nx.Defn.grad(x, fn x ->
              apply(f, [x | tl(args)])
              |> flat()
              |> Enum.map(&Nx.sum(Nx.sin(&1)))
              |> Enum.reduce(&Nx.add/2)
            end)
          end
        end

        g1 = jit.(loss.(fused)).(hd(args))
        g2 = jit.(loss.(plain)).(hd(args))
        assert Nx.all_close(g1, g2, atol: 1.0e-4) |> Nx.to_number() == 1
      end
    end

    defp flat(t), do: Nx.Defn.Composite.flatten_list([t])
  end
end
