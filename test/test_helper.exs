# Tags:
#   :nx   - needs Nx (excluded when Nx is not loaded, e.g. on CI without hex)
#   :cuda - needs a usable GPU (excluded when CUDA is not available)
#   :axon - needs Axon (parity tests against Axon.lstm/Axon.gru)
#   :exla - needs EXLA's EXLA.CustomCall protocol (EXLA >= 0.12) and Axon
nx? = Code.ensure_loaded?(Nx)
axon? = Code.ensure_loaded?(Axon)
exla? = Code.ensure_loaded?(EXLA.CustomCall) and axon?
# Nx carried in ERL_LIBS (the GPU harness) is on the code path but not started.
if nx?, do: Application.ensure_all_started(:nx)
# With EXLA's sources but no GPU the handlers cannot be loaded: declare them registered, so that
# every graph of the suite takes the custom-call path (EXLA's host client skips the specs).
if exla?, do: FusedKernels.XLA.registered(true)
cuda? = FusedKernels.Backend.cuda_available?()

exclude =
  [] ++
    if(nx?, do: [], else: [:nx]) ++
    if(axon?, do: [], else: [:axon]) ++
    if(exla?, do: [], else: [:exla]) ++
    if(cuda?, do: [], else: [:cuda])

IO.puts(
  "fused_kernels tests: NIF #{inspect(FusedKernels.Native.status())}, CUDA #{cuda?}, Nx #{nx?}" <>
    if(exclude == [], do: "", else: "; excluding #{inspect(exclude)}")
)

ExUnit.start(exclude: exclude)
Code.require_file("support/nif_fuzz.exs", __DIR__)

defmodule FusedKernels.TestRef do
  @moduledoc "f64 references and helpers shared by the tests."

  def random_list(n), do: for(_ <- 1..n, do: :rand.uniform() * 4 - 2)

  defdelegate encode(list, type), to: FusedKernels.Sample, as: :encode_values

  @doc "Checks `ScaledSoftmax.native/2` on `backend` against the f64 reference."
  def assert_softmax_matches(backend, type, shapes) do
    for shape <- shapes, causal <- [false, true] do
      bin = encode(random_list(Tuple.product(shape)), type)

      {out, ^shape, ^type} =
        FusedKernels.ScaledSoftmax.native({bin, shape, type},
          backend: backend,
          scale: 0.37,
          causal: causal
        )

      err = rel_l2(decode(out, type), softmax(decode(bin, type), shape, 0.37, causal))

      ExUnit.Assertions.assert(
        err <= tolerance(type),
        "#{backend} #{inspect(type)} #{inspect(shape)} causal=#{causal}: rel L2 #{err}"
      )
    end
  end

  @doc "Decodes a binary; NaN and infinities (which Elixir floats cannot hold) become :nan."
  def decode(bin, {:f, bits}) do
    size = div(bits, 8)

    for <<chunk::binary-size(size) <- bin>> do
      case chunk do
        <<v::float-size(bits)-native>> -> v
        _ -> :nan
      end
    end
  end

  def decode(bin, {:bf, 16}) do
    for <<h::16-native <- bin>> do
      case <<h::16, 0::16>> do
        <<v::float-32-big>> -> v
        _ -> :nan
      end
    end
  end

  @doc "Reference softmax(scale * x) over rows of `sk`, causal bottom-right, in f64."
  def softmax(list, shape, scale, causal) do
    {sq, sk} =
      case shape do
        {rows, cols} -> {rows, cols}
        {_, _, sq, sk} -> {sq, sk}
      end

    list
    |> Enum.chunk_every(sk)
    |> Enum.with_index()
    |> Enum.flat_map(fn {row, r} ->
      limit = if causal, do: min(max(rem(r, sq) + sk - sq + 1, 0), sk), else: sk
      {kept, masked} = Enum.split(row, limit)
      m = kept |> Enum.map(&(&1 * scale)) |> Enum.max(fn -> 0.0 end)
      e = Enum.map(kept, &:math.exp(&1 * scale - m))
      z = Enum.sum(e)
      Enum.map(e, &(&1 / z)) ++ Enum.map(masked, fn _ -> 0.0 end)
    end)
  end

  @doc "Relative L2 error; :infinity when any value is NaN or lengths differ."
  def rel_l2(out, ref) do
    if length(out) != length(ref) or Enum.any?(out, &(&1 == :nan)) do
      :infinity
    else
      {num, den} =
        Enum.zip(out, ref)
        |> Enum.reduce({0.0, 0.0}, fn {o, r}, {n, d} -> {n + (o - r) * (o - r), d + r * r} end)

      if den == 0.0, do: :math.sqrt(num), else: :math.sqrt(num / den)
    end
  end

  # `Native.<op>_async(args)` as `route/1` gives it.
  def cpu_route(op, args), do: route(fn -> apply(FusedKernels.Native, :"#{op}_async", args) end)

  # A CPU NIF call `call.()`: `{:dirty, reply}` when the NIF answered the reply itself (the
  # call continued on a dirty scheduler), `{:lanes, reply}` when it answered a reference (the
  # call was queued on the job lanes and the reply followed as a message).
  def route(call) do
    case call.() do
      ref when is_reference(ref) ->
        receive do
          {^ref, reply} -> {:lanes, reply}
        end

      reply ->
        {:dirty, reply}
    end
  end

  def tolerance({:f, 32}), do: 1.0e-5
  def tolerance({:f, 64}), do: 1.0e-12
  def tolerance(_), do: 1.0e-2

  @doc "Resident memory of this OS process in bytes (Linux)."
  def rss_bytes do
    case File.read("/proc/self/status") do
      {:ok, status} ->
        [_, kb] = Regex.run(~r/VmRSS:\s+(\d+) kB/, status)
        String.to_integer(kb) * 1024

      _ ->
        0
    end
  end
end
