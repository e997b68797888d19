if Code.ensure_loaded?(Axon) do
  defmodule FusedKernels.AxonTest do
    # Axon models and the same models after FusedKernels.Axon.fuse/2 (or built with its
    # builders): same params, same predictions, same gradients. On Nx >= 0.11 the fused layers
    # run the native kernel through Nx.runtime_call; on older Nx they trace the pure-Nx path.
    use ExUnit.Case, async: true
    @moduletag :axon

    defp model(kind, opts \\ []) do
      input = Axon.input("x", shape: {nil, 6, 5})
      {seq, state} = apply(Axon, kind, [input, 7, [name: "rnn"] ++ opts])
      last = if kind == :lstm, do: elem(state, 1), else: elem(state, 0)
      Axon.concatenate(Axon.nx(seq, &Nx.sum(&1, axes: [1])), last)
    end

    defp init_and_x(model) do
      {init, _} = Axon.build(model)
      params = init.(Nx.template({2, 6, 5}, :f32), initial_params())
      x = Nx.tensor(for(_ <- 1..60, do: :rand.uniform() * 2 - 1)) |> Nx.reshape({2, 6, 5})
      {params, x}
    end

    # Axon 0.6 takes a params map, 0.8 an Axon.ModelState.
    defp initial_params do
      if Code.ensure_loaded?(Axon.ModelState), do: apply(Axon.ModelState, :empty, []), else: %{}
    end

    defp close?(a, b), do: Nx.all_close(a, b, atol: 1.0e-5, rtol: 1.0e-5) |> Nx.to_number() == 1

    for kind <- [:lstm, :gru] do
      test "#{kind}: the fused model predicts what the Axon model predicts" do
        plain = model(unquote(kind))
        {fused, report} = FusedKernels.Axon.fuse_with_report(plain)
        assert [%{op: unquote(kind)}] = report.swapped
        {params, x} = init_and_x(plain)
        {_, predict_plain} = Axon.build(plain)
        {_, predict_fused} = Axon.build(fused)
        assert close?(predict_fused.(params, x), predict_plain.(params, x))
      end

      test "#{kind}: with Axon's initial state (initial_state/4) the op gives Axon's numbers" do
        input = Axon.input("x", shape: {nil, 6, 5})
        # Axon's default: a random initial state (glorot_uniform from a key in the params).
        {seq, _state} = apply(Axon, unquote(kind), [input, 7, [name: "rnn"]])
        {params, x} = init_and_x(seq)
        {_, predict} = Axon.build(seq)
        expected = predict.(params, x)

        state = FusedKernels.Axon.initial_state(seq, params, x, "rnn")
        assert tuple_size(state) == if(unquote(kind) == :lstm, do: 2, else: 1)
        for t <- Tuple.to_list(state), do: assert(Nx.shape(t) == {2, 7})
        {data, _} = unwrap(params)

        # Without it the numbers differ (zeros are not Axon's state).
        {zeros, _} = apply(FusedKernels, unquote(kind), [x, data["rnn"], [backend: :nx]])
        refute close?(zeros, expected)

        backends = [:nx, :cpu] ++ if FusedKernels.Backend.cuda_available?(), do: [:cuda], else: []

        for backend <- backends do
          {ours, _} =
            apply(FusedKernels, unquote(kind), [
              x,
              data["rnn"],
              [initial_state: state, backend: backend]
            ])

          assert close?(ours, expected), "#{backend}"
        end

        assert_raise ArgumentError, ~r/no recurrent layer named "other"/, fn ->
          FusedKernels.Axon.initial_state(seq, params, x, "other")
        end
      end

      # Against Axon with `unroll: :static`: on Nx 0.7 the gradient through Axon's default
      # `:dynamic` (while-loop) unroll disagrees with finite differences, the static one agrees.
      test "#{kind}: gradients through the fused model equal the Axon model's" do
        plain = model(unquote(kind), unroll: :static)
        fused = FusedKernels.Axon.fuse(model(unquote(kind)))
        {params, x} = init_and_x(plain)

        grad = fn model ->
          {_, predict} = Axon.build(model)
          {data, wrap} = unwrap(params)

          Nx.Defn.jit(fn d ->
            Nx.Defn.grad(
              d,
              &(predict.(wrap.(&1), x) |> Nx.multiply(Nx.iota({2, 14})) |> Nx.sum())
            )
          end).(data)
        end

        g_plain = grad.(plain)
        g_fused = grad.(fused)

        for {layer, ps} <- g_plain, {name, t} <- flatten(ps) do
          assert close?(get_in(g_fused, [layer | name]), t), "#{layer} #{inspect(name)}"
        end
      end

      test "#{kind}: the builder with fused: true equals Axon's layer" do
        input = Axon.input("x", shape: {nil, 6, 5})
        {seq, _} = apply(FusedKernels.Axon, unquote(kind), [input, 7, [name: "rnn", fused: true]])
        {seq_plain, _} = apply(Axon, unquote(kind), [input, 7, [name: "rnn"]])
        {params, x} = init_and_x(seq_plain)
        {_, p1} = Axon.build(seq)
        {_, p2} = Axon.build(seq_plain)
        assert close?(p1.(params, x), p2.(params, x))
      end
    end

    test "fuse leaves nodes with other activations, and only:/except: select nodes" do
      relu = model(:lstm, activation: :relu)
      {_, report} = FusedKernels.Axon.fuse_with_report(relu)
      assert report.swapped == []
      assert [%{name: "rnn", reason: :non_default_activation}] = report.left

      {_, report} = FusedKernels.Axon.fuse_with_report(model(:gru), except: [:gru])
      assert [%{name: "rnn", reason: :not_selected}] = report.left

      assert_raise ArgumentError, ~r/fused: true needs the default activation/, fn ->
        FusedKernels.Axon.lstm(Axon.input("x", shape: {nil, 6, 5}), 7,
          activation: :relu,
          fused: true
        )
      end
    end

    defp unwrap(%{__struct__: _, data: data} = state), do: {data, &%{state | data: &1}}
    defp unwrap(%{} = params), do: {params, & &1}

    defp flatten(%{} = m),
      do:
        Enum.flat_map(m, fn {k, v} ->
          if is_map(v) and not is_struct(v),
            do: Enum.map(flatten(v), fn {p, t} -> {[k | p], t} end),
            else: [{[k], v}]
        end)
  end
end
