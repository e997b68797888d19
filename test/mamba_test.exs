# Compiled only where Nx is loaded (its tests are tagged :nx as well).
if Code.ensure_loaded?(Nx) do
  defmodule FusedKernels.MambaTest do
    # Selective scan, norms and the Mamba block: every backend against a plain reference
    # (a sequential Elixir-loop scan; the block as a composition of plain Nx ops).
    use ExUnit.Case, async: true
    @moduletag :nx

    alias FusedKernels.{MambaBlock, TestRef}

    defp backends do
      [:nx, :cpu] ++ if(FusedKernels.Backend.cuda_available?(), do: [:cuda], else: [])
    end

    defp rand(shape, scale \\ 1.0, shift \\ 0.0) do
      TestRef.random_list(Tuple.product(shape))
      |> Enum.map(&(&1 * scale + shift))
      |> Nx.tensor(type: :f32)
      |> Nx.reshape(shape)
    end

    defp rel(got, want) do
      g = got |> Nx.as_type(:f64) |> Nx.flatten() |> Nx.to_list()
      w = want |> Nx.as_type(:f64) |> Nx.flatten() |> Nx.to_list()
      TestRef.rel_l2(g, w)
    end

    # Sequential reference in f64 with plain Elixir/Nx ops, one step at a time.
    defp loop_scan(u, delta, a, b, c, opts) do
      f = &Nx.as_type(&1, :f64)
      {bsz, seq, dim} = Nx.shape(u)
      n = elem(Nx.shape(a), 1)
      dt = f.(delta)
      dt = if opts[:delta_bias], do: Nx.add(dt, f.(opts[:delta_bias])), else: dt
      dt = if opts[:delta_softplus], do: Nx.log1p(Nx.exp(dt)), else: dt

      h0 =
        if opts[:initial_state],
          do: f.(opts[:initial_state]),
          else: Nx.broadcast(0.0, {bsz, dim, n}) |> f.()

      {ys, h} =
        Enum.map_reduce(0..(seq - 1), h0, fn t, h ->
          dtt = dt[[.., t]]

          w =
            if opts[:b_discretization] == :mean_dt,
              do: Nx.broadcast(Nx.mean(dtt, axes: [1], keep_axes: true), {bsz, dim}),
              else: dtt

          bt = f.(b[[.., t]]) |> Nx.new_axis(1)
          ct = f.(c[[.., t]]) |> Nx.new_axis(1)
          ut = f.(u[[.., t]])

          h =
            Nx.add(
              Nx.multiply(Nx.exp(Nx.multiply(Nx.new_axis(dtt, 2), f.(a))), h),
              Nx.multiply(Nx.new_axis(Nx.multiply(w, ut), 2), bt)
            )

          y = Nx.sum(Nx.multiply(h, ct), axes: [2])
          y = if opts[:d], do: Nx.add(y, Nx.multiply(f.(opts[:d]), ut)), else: y

          y =
            if opts[:z],
              do:
                (
                  z = f.(opts[:z][[.., t]])
                  Nx.multiply(y, Nx.multiply(z, Nx.sigmoid(z)))
                ),
              else: y

          {y, h}
        end)

      {Nx.stack(ys, axis: 1), h}
    end

    test "selective_scan on every backend matches a sequential f64 loop" do
      for {bsz, seq, dim, n} <- [{2, 1, 3, 1}, {2, 61, 37, 16}, {1, 17, 8, 64}],
          opts <- [
            [],
            [delta_softplus: true, d: :d, z: :z, delta_bias: :bias],
            [delta_softplus: true, initial_state: :h0, return_last_state: true],
            [delta_softplus: true, b_discretization: :mean_dt, z: :z]
          ],
          backend <- backends() do
        u = rand({bsz, seq, dim})

        delta =
          if opts[:delta_softplus],
            do: rand({bsz, seq, dim}),
            else: rand({bsz, seq, dim}, 0.05, 0.06)

        a = rand({dim, n}, 0.5, -1.0)
        {b, c} = {rand({bsz, seq, n}), rand({bsz, seq, n})}

        extra = %{
          d: rand({dim}),
          z: rand({bsz, seq, dim}),
          bias: rand({dim}, 0.3),
          h0: rand({bsz, dim, n})
        }

        opts =
          Enum.map(opts, fn
            {k, v} when is_atom(v) and is_map_key(extra, v) -> {k, extra[v]}
            kv -> kv
          end)

        {want, want_h} = loop_scan(u, delta, a, b, c, opts)

        case FusedKernels.selective_scan(u, delta, a, b, c, [backend: backend] ++ opts) do
          {y, h} ->
            assert rel(y, want) <= 1.0e-5,
                   "#{backend} #{inspect(Keyword.keys(opts))}: #{rel(y, want)}"

            assert rel(h, want_h) <= 1.0e-5

          y ->
            assert Nx.shape(y) == {bsz, seq, dim}

            assert rel(y, want) <= 1.0e-5,
                   "#{backend} #{inspect(Keyword.keys(opts))}: #{rel(y, want)}"
        end
      end
    end

    test "grouped B/C and bf16 inputs" do
      for backend <- backends() do
        u = rand({1, 20, 8})
        delta = rand({1, 20, 8})
        a = rand({8, 4}, 0.5, -1.0)
        {b, c} = {rand({1, 20, 2, 4}), rand({1, 20, 2, 4})}
        # Channels 0..3 use group 0, 4..7 group 1: each half is an ungrouped scan.
        y = FusedKernels.selective_scan(u, delta, a, b, c, backend: backend, delta_softplus: true)

        for g <- 0..1 do
          ch = (4 * g)..(4 * g + 3)

          {want, _} =
            loop_scan(
              u[[.., .., ch]],
              delta[[.., .., ch]],
              a[[ch]],
              b[[.., .., g]],
              c[[.., .., g]],
              delta_softplus: true
            )

          assert rel(y[[.., .., ch]], want) <= 1.0e-5
        end

        bf = &Nx.as_type(&1, :bf16)

        y16 =
          FusedKernels.selective_scan(bf.(u), bf.(delta), a, bf.(b), bf.(c),
            backend: backend,
            delta_softplus: true
          )

        assert Nx.type(y16) == {:bf, 16}
        # Against f32 arithmetic on the same bf16-rounded inputs.
        r = &(&1 |> bf.() |> Nx.as_type(:f32))

        y_rounded =
          FusedKernels.selective_scan(r.(u), r.(delta), a, r.(b), r.(c),
            backend: :nx,
            delta_softplus: true
          )

        assert rel(y16, y_rounded) <= 1.0e-2
        ref = FusedKernels.selective_scan(u, delta, a, b, c, backend: :nx, delta_softplus: true)
        assert rel(y, ref) <= 1.0e-5
      end
    end

    test "layer_norm and rms_norm with and without a fused residual" do
      x = rand({3, 60, 256}, 1.0, 2.0)
      r = rand({3, 60, 256})
      {g, b} = {rand({256}), rand({256})}

      for backend <- backends() do
        sum = Nx.add(x, r)
        cen = Nx.subtract(sum, Nx.mean(sum, axes: [-1], keep_axes: true))
        var = Nx.mean(Nx.multiply(cen, cen), axes: [-1], keep_axes: true)
        want = cen |> Nx.divide(Nx.sqrt(Nx.add(var, 1.0e-5))) |> Nx.multiply(g) |> Nx.add(b)
        {y, s} = FusedKernels.layer_norm(x, g, b, residual: r, backend: backend)
        assert rel(y, want) <= 1.0e-5 and rel(s, Nx.add(x, r)) <= 1.0e-6
        y = FusedKernels.rms_norm(x, g, eps: 1.0e-6, backend: backend)
        ms = Nx.mean(Nx.multiply(x, x), axes: [-1], keep_axes: true)
        assert rel(y, Nx.multiply(Nx.divide(x, Nx.sqrt(Nx.add(ms, 1.0e-6))), g)) <= 1.0e-5
      end
    end

    test "the Mamba block on every backend matches the plain-Nx composition, both discretizations" do
      params = FusedKernels.Sample.mamba_block_params("mamba_block_1", 32, 64, 8, 4, 4)

      params =
        Map.new(params, fn {k, v} ->
          {k, Map.new(v, fn {p, t} -> {p, apply(FusedKernels.Tensor, :to_nx, [t])} end)}
        end)

      x = rand({2, 13, 32})

      for disc <- [:per_channel, :mean_dt] do
        want =
          MambaBlock.nx(Nx.as_type(x, :f64), params, name: "mamba_block_1", b_discretization: disc)

        for backend <- backends() do
          y =
            FusedKernels.mamba_block(x, params,
              name: "mamba_block_1",
              b_discretization: disc,
              backend: backend
            )

          assert Nx.shape(y) == {2, 13, 32}
          assert rel(y, want) <= 1.0e-5, "#{backend} #{disc}: #{rel(y, want)}"
        end
      end

      assert_raise ArgumentError, ~r/missing "mamba_block_norm" => "gamma"/, fn ->
        FusedKernels.mamba_block(x, params, backend: :cpu)
      end
    end

    test "bad input names the argument" do
      u = rand({1, 4, 3})

      assert_raise ArgumentError, ~r/a: state size 300 is over the supported 256/, fn ->
        FusedKernels.selective_scan(u, u, rand({3, 300}), rand({1, 4, 300}), rand({1, 4, 300}),
          backend: :cpu
        )
      end

      assert_raise ArgumentError, ~r/a: state size 300 is over the supported 256/, fn ->
        FusedKernels.selective_scan(u, u, rand({3, 300}), rand({1, 4, 300}), rand({1, 4, 300}),
          backend: :nx
        )
      end

      assert_raise ArgumentError, ~r/delta: expected shape \{1, 4, 3\}/, fn ->
        FusedKernels.selective_scan(
          u,
          rand({1, 4, 2}),
          rand({3, 2}),
          rand({1, 4, 2}),
          rand({1, 4, 2}),
          backend: :cpu
        )
      end

      assert_raise ArgumentError, ~r/gamma: expected shape \{3\}/, fn ->
        FusedKernels.layer_norm(u, rand({4}), rand({3}), backend: :cpu)
      end
    end
  end
end
