defmodule FusedKernels.NativeTest do
  # The NIF and the CPU-native backend, with no Nx: what CI runs.
  use ExUnit.Case, async: true

  alias FusedKernels.{Native, ScaledSoftmax, TestRef}

  test "the NIF loads and info/0 reports the machine" do
    assert Native.status() == :ok
    info = FusedKernels.info()
    assert info.nif_loaded
    assert is_binary(info.cache_dir)
    assert is_boolean(info.cuda_available)

    if info.cuda_available do
      for key <- [
            :device_name,
            :compute_capability,
            :memory_total,
            :driver_version,
            :nvrtc_version,
            :route_as,
            :features,
            :paths
          ],
          do: assert(Map.has_key?(info, key))

      assert info.features.mma_f16
      assert {"dense", _} = List.keyfind(info.paths, "dense", 0)
    else
      assert info.reason =~ "CUDA is not available"
    end
  end

  @shapes [
    {1, 1},
    {1, 147},
    {61, 61},
    {7, 200},
    {3, 1000},
    {1, 4, 60, 60},
    {2, 3, 13, 23},
    {1, 2, 23, 13}
  ]

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}] do
    test "cpu scaled_softmax matches the f64 reference for #{inspect(type)}" do
      TestRef.assert_softmax_matches(:cpu, unquote(Macro.escape(type)), @shapes)
    end
  end

  test "bad arguments raise ArgumentError naming the argument" do
    good = {TestRef.encode([1.0, 2.0], {:f, 32}), {1, 2}, {:f, 32}}

    assert_raise ArgumentError, ~r/x: binary has 7 bytes but shape \{1, 2\}/, fn ->
      ScaledSoftmax.native({<<0::56>>, {1, 2}, {:f, 32}}, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/x: dimension 0 of shape \{0, 2\} is 0/, fn ->
      ScaledSoftmax.native({<<>>, {0, 2}, {:f, 32}}, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/unsupported type \{:s, 32\}/, fn ->
      ScaledSoftmax.native({<<0::64>>, {1, 2}, {:s, 32}}, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/x: scaled_softmax takes a 2-D/, fn ->
      ScaledSoftmax.native({<<0::64>>, {2}, {:f, 32}}, backend: :cpu)
    end

    assert_raise ArgumentError, ~r/scale must be a number/, fn ->
      ScaledSoftmax.native(good, backend: :cpu, scale: "x")
    end

    assert_raise ArgumentError, ~r/backend must be one of/, fn ->
      ScaledSoftmax.native(good, backend: :tpu)
    end

    assert_raise ArgumentError, ~r/expected an Nx tensor, a FusedKernels.Buffer/, fn ->
      ScaledSoftmax.native([1, 2], backend: :cpu)
    end

    assert {:error, {:argument, "x: data must be a binary"}} =
             Native.scaled_softmax(%{x: {[1], {1}, {:f, 32}}}, %{
               scale: 1.0,
               causal: false,
               backend: :cpu,
               out: :host
             })
  end

  test "unaligned binaries are copied, not cast" do
    # A sub-binary starting at an odd byte offset.
    bin = TestRef.encode([0.5, 1.5, -1.0], {:f, 32})
    <<_::8, unaligned::binary-size(12), _::8>> = <<0>> <> bin <> <<0>>
    {a, _, _} = ScaledSoftmax.native({bin, {1, 3}, {:f, 32}}, backend: :cpu)
    {b, _, _} = ScaledSoftmax.native({unaligned, {1, 3}, {:f, 32}}, backend: :cpu)
    assert a == b
  end

  test "without CUDA, :cuda is refused with the reason and buffers say why" do
    unless FusedKernels.Backend.cuda_available?() do
      assert_raise FusedKernels.Error, ~r/CUDA is not available/, fn ->
        ScaledSoftmax.native({<<0::32>>, {1, 1}, {:f, 32}}, backend: :cuda)
      end

      assert {:error, {:unavailable, _}} =
               Native.buffer_upload({<<0::32>>, {1, 1}, {:f, 32}}, nil)

      assert {:error, {:unavailable, _}} = Native.cuda_mem_info(nil)
    end
  end
end
