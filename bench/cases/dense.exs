defmodule FusedKernels.Bench.Dense do
  @moduledoc false
  alias FusedKernels.{Buffer, Dense, Sample}

  # {name, kind, {m, k, n}, type, opts}: ExPhil's shapes (f32 inference, bf16 too) and one
  # large one. Names are what bench/gpu/side_dense.py matches on.
  @cases [
    {"dense 1x288x768 bias+gelu", :dense, {1, 288, 768}, {:f, 32}, [activation: :gelu]},
    {"dense 60x256x1024 bias+gelu", :dense, {60, 256, 1024}, {:f, 32}, [activation: :gelu]},
    {"dense 60x256x1024 bias+gelu bf16", :dense, {60, 256, 1024}, {:bf, 16}, [activation: :gelu]},
    {"dense 3840x256x256 bias+residual", :dense, {3840, 256, 256}, {:f, 32}, [residual: true]},
    {"dense 3840x256x256 bias+residual bf16", :dense, {3840, 256, 256}, {:bf, 16},
     [residual: true]},
    {"swiglu 60x256x1024", :swiglu, {60, 256, 1024}, {:f, 32}, []},
    {"layer_norm_dense 60x256x1024", :layer_norm_dense, {60, 256, 1024}, {:f, 32}, []},
    {"rms_norm_dense 3840x256x256", :rms_norm_dense, {3840, 256, 256}, {:f, 32}, []},
    {"dense 4096^3 bias+gelu+residual bf16", :dense, {4096, 4096, 4096}, {:bf, 16},
     [activation: :gelu, residual: true]},
    {"dense 4096^3 bias+gelu f32", :dense, {4096, 4096, 4096}, {:f, 32}, [activation: :gelu]},
    {"swiglu 4096^3 bf16", :swiglu, {4096, 4096, 4096}, {:bf, 16}, []},
    {"rms_norm_dense 4096^3 bf16", :rms_norm_dense, {4096, 4096, 4096}, {:bf, 16}, []},
    {"layer_norm_dense 4096^3 bf16", :layer_norm_dense, {4096, 4096, 4096}, {:bf, 16}, []}
  ]

  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    Enum.map(@cases, fn {name, kind, {m, k, n} = mkn, type, opts} ->
      %{name: name, shape: mkn, type: type, runner: &runner(&1, kind, {m, k, n}, type, opts)}
    end)
  end

  # Random values tiled from a 64K-element block: building 16M-element tensors element by
  # element in Elixir would take longer than the benchmark.
  defp triple(shape, type) do
    count = Tuple.product(shape)
    {block, _, _} = Sample.random_triple({min(count, 65_536)}, type)
    bin = :binary.copy(block, div(count + 65_535, 65_536))
    {binary_part(bin, 0, count * div(elem(type, 1), 8)), shape, type}
  end

  defp operands(kind, {m, k, n}, type, opts) do
    t = &triple(&1, type)
    base = %{x: t.({m, k}), kernel: t.({k, n}), bias: t.({n})}

    base =
      case kind do
        :swiglu -> Map.merge(base, %{kernel_up: t.({k, n}), bias_up: t.({n})})
        :rms_norm_dense -> Map.put(base, :gamma, t.({k}))
        :layer_norm_dense -> Map.merge(base, %{gamma: t.({k}), beta: t.({k})})
        :dense -> base
      end

    if opts[:residual], do: Map.put(base, :residual, t.({m, n})), else: base
  end

  defp invoke(kind, o, opts) do
    act = Keyword.get(opts, :activation, :none)

    case kind do
      :dense ->
        Dense.dense(o.x, o.kernel, o.bias,
          activation: act,
          residual: o[:residual],
          backend: opts[:backend],
          out: opts[:out]
        )

      :swiglu ->
        Dense.swiglu(o.x, o.kernel, o.kernel_up,
          bias_gate: o.bias,
          bias_up: o.bias_up,
          backend: opts[:backend],
          out: opts[:out]
        )

      :rms_norm_dense ->
        Dense.rms_norm_dense(o.x, o.gamma, o.kernel,
          bias: o.bias,
          backend: opts[:backend],
          out: opts[:out]
        )

      :layer_norm_dense ->
        Dense.layer_norm_dense(o.x, o.gamma, o.beta, o.kernel,
          bias: o.bias,
          backend: opts[:backend],
          out: opts[:out]
        )
    end
  end

  defp runner(:cuda_resident, kind, mkn, type, opts) do
    o = kind |> operands(mkn, type, opts) |> Map.new(fn {s, t} -> {s, Buffer.upload(t)} end)

    fn ->
      invoke(kind, o, opts ++ [backend: :cuda, out: :device])
      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(backend, kind, {m, k, n} = mkn, type, opts) when backend in [:cuda, :cpu] do
    # Host round trips and CPU GEMMs of the large shape would take minutes of runs.
    if m * k * n <= 300_000_000 do
      o = operands(kind, mkn, type, opts)
      fn -> invoke(kind, o, opts ++ [backend: backend, out: :host]) end
    end
  end

  defp runner(:nx, kind, {m, k, n} = mkn, type, opts) do
    if m * k * n <= 300_000 and Code.ensure_loaded?(Nx) do
      o =
        kind
        |> operands(mkn, type, opts)
        |> Map.new(fn {s, {bin, shape, t}} ->
          {s, apply(Nx, :reshape, [apply(Nx, :from_binary, [bin, t]), shape])}
        end)

      fn -> invoke(kind, o, opts ++ [backend: :nx, out: :host]) end
    end
  end
end
