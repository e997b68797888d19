defmodule FusedKernels.Bench do
  @moduledoc """
  The benchmark behind `mix bench`: each case on each available backend, timed from Elixir
  around the whole call (argument passing, transfers and the kernel), median/p95/p99 over
  many runs after warm-up, with the 60-FPS verdict (p95 under 16.67 ms).

  Native rows need no Nx; pure-Nx rows are added when Nx is loaded.
  """

  @frame_ms 1000 / 60

  # Each op contributes its cases (bench/cases/<op>.exs) through `bench_cases/1` (the run's
  # options), returning maps with `:name`,
  # `:shape` (a tuple, for the table), `:type` and `:runner`: `fn backend -> fun | nil end`,
  # where `fun` runs one call synchronously and nil means "not on this backend".
  @case_modules [
    FusedKernels.Bench.ScaledSoftmax,
    FusedKernels.Bench.Dense,
    FusedKernels.Bench.Backbone,
    FusedKernels.Bench.FlashAttention,
    FusedKernels.Bench.Rnn,
    FusedKernels.Bench.SelectiveScan,
    FusedKernels.Bench.MambaBlock
  ]

  @doc "Every benchmark case of every op."
  @spec cases(keyword) :: [map]
  def cases(opts \\ []), do: Enum.flat_map(@case_modules, & &1.bench_cases(opts))

  @doc """
  Backends present on this machine, in the order the table shows them. `:cuda` takes host
  tensors in and out (transfers included); `:cuda_resident` keeps input and output on the GPU.
  """
  @spec available_backends() :: [atom]
  def available_backends do
    [
      FusedKernels.Backend.cuda_available?() && :cuda,
      FusedKernels.Backend.cuda_available?() && :cuda_resident,
      FusedKernels.Native.loaded?() && :cpu,
      Code.ensure_loaded?(Nx) && :nx
    ]
    |> Enum.filter(& &1)
  end

  @doc """
  Runs the benchmark. Options: `quick` (fewer runs), `only` (substring of case names),
  `backend` (list of backends), `json` (path to write results), `runs` (timed runs),
  `export` (a directory for the backbones' params and outputs, read by
  bench/gpu/side_backbone.py).
  """
  @spec run(keyword) :: [map]
  def run(opts \\ []) do
    runs = Keyword.get(opts, :runs, if(opts[:quick], do: 20, else: 100))
    backends = Keyword.get(opts, :backend, available_backends())
    only = Keyword.get(opts, :only)
    # Nx carried through ERL_LIBS (the GPU harness) is loadable but not started.
    if Code.ensure_loaded?(Nx), do: Application.ensure_all_started(:nx)

    IO.puts("fused_kernels bench: #{machine()}\n")

    rows =
      for c <- cases(opts),
          is_nil(only) or String.contains?(c.name, only),
          backend <- backends,
          backend in available_backends(),
          row = measure(c, backend, runs),
          row != nil do
        IO.puts(progress(row))
        row
      end

    IO.puts("\n" <> table(rows))

    # The export directory goes into the JSON too, so side_backbone.py finds the params.
    if path = opts[:json] do
      doc = %{machine: machine(), rows: rows}
      doc = if dir = opts[:export], do: Map.put(doc, :export, dir), else: doc
      File.write!(path, FusedKernels.Bench.JSON.encode(doc))
    end

    rows
  end

  defp measure(%{name: name, shape: shape, type: type, runner: runner}, backend, runs) do
    case runner.(backend) do
      nil ->
        nil

      fun ->
        # Warm-up: kernel compilation/cache load, first allocations.
        first = time_ms(fun)
        # Very slow rows (pure Nx on big shapes) skip the extra warm-up and get fewer runs
        # (at least 2), and the table says so.
        if first <= 1000, do: Enum.each(1..5, fn _ -> fun.() end)
        n = if first > 200, do: max(2, min(runs, div(10_000, max(round(first), 1)))), else: runs
        times = Enum.map(1..n, fn _ -> time_ms(fun) end) |> Enum.sort()

        %{
          case: name,
          backend: backend,
          shape: Tuple.to_list(shape),
          type: type_name(type),
          runs: n,
          reduced_runs: n < runs,
          median_ms: pct(times, 0.5),
          p95_ms: pct(times, 0.95),
          p99_ms: pct(times, 0.99),
          fps: 1000 / pct(times, 0.5),
          sixty_fps: pct(times, 0.95) < @frame_ms
        }
    end
  end

  defp time_ms(fun) do
    t0 = System.monotonic_time(:nanosecond)
    fun.()
    (System.monotonic_time(:nanosecond) - t0) / 1.0e6
  end

  defp pct(sorted, q), do: Enum.at(sorted, min(length(sorted) - 1, floor(q * length(sorted))))

  defp type_name({k, b}), do: "#{k}#{b}"

  defp progress(r),
    do:
      "  #{r.case} [#{r.backend}] median #{fmt(r.median_ms)} ms p95 #{fmt(r.p95_ms)} ms (#{r.runs} runs)"

  @doc "The results as a table."
  @spec table([map]) :: String.t()
  def table(rows) do
    header = [
      "case",
      "backend",
      "shape",
      "type",
      "runs",
      "median ms",
      "p95 ms",
      "p99 ms",
      "FPS",
      "60 FPS"
    ]

    body =
      Enum.map(rows, fn r ->
        [
          r.case,
          to_string(r.backend),
          Enum.join(r.shape, "x"),
          r.type,
          "#{r.runs}#{if r.reduced_runs, do: "*", else: ""}",
          fmt(r.median_ms),
          fmt(r.p95_ms),
          fmt(r.p99_ms),
          fmt(r.fps),
          if(r.sixty_fps, do: "yes", else: "NO")
        ]
      end)

    widths =
      Enum.reduce([header | body], List.duplicate(0, length(header)), fn row, acc ->
        Enum.zip_with(row, acc, &max(String.length(&1), &2))
      end)

    line = fn row ->
      "| " <> Enum.join(Enum.zip_with(row, widths, &String.pad_trailing/2), " | ") <> " |"
    end

    sep = "|" <> Enum.map_join(widths, "|", &String.duplicate("-", &1 + 2)) <> "|"

    note =
      if Enum.any?(rows, & &1.reduced_runs),
        do: "\n* fewer runs: one run takes over 200 ms",
        else: ""

    Enum.join([line.(header), sep | Enum.map(body, line)], "\n") <> note
  end

  defp fmt(v) when v >= 100, do: :erlang.float_to_binary(v * 1.0, decimals: 0)
  defp fmt(v) when v >= 1, do: :erlang.float_to_binary(v * 1.0, decimals: 2)
  defp fmt(v), do: :erlang.float_to_binary(v * 1.0, decimals: 4)

  @doc "One line naming the machine and what the native layer found."
  @spec machine() :: String.t()
  def machine do
    info = FusedKernels.info()
    cores = :erlang.system_info(:logical_processors_available)
    cpu = "#{:erlang.system_info(:system_architecture)}, #{cores} cores"

    gpu =
      if info.cuda_available,
        do:
          "#{info.device_name} (sm_#{elem(info.compute_capability, 0)}#{elem(info.compute_capability, 1)})",
        else: "no GPU (#{info.reason})"

    "#{cpu}; #{gpu}; Elixir #{System.version()}/OTP #{System.otp_release()}" <>
      if(Code.ensure_loaded?(Nx), do: "; Nx #{Application.spec(:nx, :vsn)}", else: "; no Nx")
  end
end

defmodule FusedKernels.Bench.JSON do
  @moduledoc false
  # A small encoder so `--json` works on Elixir 1.14 without a JSON dependency.
  @spec encode(term) :: String.t()
  def encode(v) when is_map(v),
    do:
      "{" <>
        Enum.map_join(v, ",", fn {k, x} -> encode(to_string(k)) <> ":" <> encode(x) end) <> "}"

  def encode(v) when is_list(v), do: "[" <> Enum.map_join(v, ",", &encode/1) <> "]"
  def encode(v) when is_boolean(v) or is_nil(v), do: if(is_nil(v), do: "null", else: to_string(v))
  def encode(v) when is_atom(v), do: encode(Atom.to_string(v))
  def encode(v) when is_integer(v), do: Integer.to_string(v)
  def encode(v) when is_float(v), do: :erlang.float_to_binary(v, [:short])

  def encode(v) when is_binary(v) do
    escaped =
      v
      |> String.replace("\\", "\\\\")
      |> String.replace("\"", "\\\"")
      |> String.replace("\n", "\\n")

    "\"" <> escaped <> "\""
  end
end
