defmodule FusedKernels.Bench.FlashAttention do
  @moduledoc false
  alias FusedKernels.{Sample, FlashAttention}

  # {name, q shape (bshd), kv heads, type, opts}; the issue's and ExPhil's shapes.
  @spec shapes() :: [tuple]
  def shapes do
    [
      {"flash_attention exphil B1 H4 S60 D64 causal f32", {1, 60, 4, 64}, 4, {:f, 32},
       [causal: true]},
      {"flash_attention exphil B1 H4 S60 D64 causal bf16", {1, 60, 4, 64}, 4, {:bf, 16},
       [causal: true]},
      {"flash_attention B1 H8 S512 D64 f16", {1, 512, 8, 64}, 8, {:f, 16}, []},
      {"flash_attention B4 H16 S4096 D128 bf16", {4, 4096, 16, 128}, 16, {:bf, 16}, []},
      {"flash_attention B4 H16 S4096 D128 bf16 causal", {4, 4096, 16, 128}, 16, {:bf, 16},
       [causal: true]},
      {"flash_attention B8 H16 S4096 D64 f16", {8, 4096, 16, 64}, 16, {:f, 16}, []}
    ]
  end

  # The big shapes are timed by the Rust kernel bench (side_flash_attention.py): building
  # their random inputs in Elixir would take minutes.
  @spec bench_cases(keyword) :: [map]
  def bench_cases(_opts) do
    shapes()
    |> Enum.filter(fn {_, shape, _, _, _} -> Tuple.product(shape) <= 1_000_000 end)
    |> Enum.map(fn {name, shape, kvh, type, opts} ->
      %{name: name, shape: shape, type: type, runner: &runner(&1, shape, kvh, type, opts)}
    end)
  end

  defp inputs(shape, kvh, type) do
    {b, s, _h, d} = shape
    [shape, {b, s, kvh, d}, {b, s, kvh, d}] |> Enum.map(&Sample.random_triple(&1, type))
  end

  defp runner(:cuda_resident, shape, kvh, type, opts) do
    [q, k, v] = Enum.map(inputs(shape, kvh, type), &FusedKernels.Buffer.upload/1)

    fn ->
      FlashAttention.native(q, k, v, [backend: :cuda, out: :device] ++ opts)
      FusedKernels.Native.cuda_synchronize(nil)
    end
  end

  defp runner(:cuda, shape, kvh, type, opts) do
    # Host tensors in and out: only for the small (latency) shapes.
    if Tuple.product(shape) <= 1_000_000 do
      [q, k, v] = inputs(shape, kvh, type)
      fn -> FlashAttention.native(q, k, v, [backend: :cuda] ++ opts) end
    end
  end

  defp runner(:cpu, shape, kvh, type, opts) do
    if Tuple.product(shape) <= 300_000 do
      [q, k, v] = inputs(shape, kvh, type)
      fn -> FlashAttention.native(q, k, v, [backend: :cpu] ++ opts) end
    end
  end

  defp runner(:nx, shape, kvh, type, opts) do
    if Tuple.product(shape) <= 20_000 and Code.ensure_loaded?(Nx) do
      [q, k, v] =
        inputs(shape, kvh, type)
        |> Enum.map(fn {bin, s, t} ->
          apply(Nx, :reshape, [apply(Nx, :from_binary, [bin, t]), s])
        end)

      fn -> apply(FlashAttention, :nx, [q, k, v, opts]) end
    end
  end
end
