defmodule FusedKernels.CudaTest do
  # Runs where a GPU is usable (the GPU harness); excluded elsewhere.
  use ExUnit.Case
  @moduletag :cuda

  alias FusedKernels.{Buffer, Native, ScaledSoftmax, TestRef}

  test "info/0 reports the GPU" do
    info = FusedKernels.info()
    assert info.cuda_available
    assert is_binary(info.device_name) and info.memory_total > 0
    assert {major, _} = info.compute_capability
    assert major >= 7
    assert {13, _} = info.nvrtc_version

    IO.puts(
      "GPU: #{info.device_name} sm_#{elem(info.compute_capability, 0)}#{elem(info.compute_capability, 1)}, driver #{info.driver_version}"
    )
  end

  @shapes [
    {1, 1},
    {1, 147},
    {61, 61},
    {7, 200},
    {3, 1000},
    {2, 3000},
    {1, 4, 60, 60},
    {2, 3, 113, 203},
    {1, 1, 3, 5000},
    # 16-byte load/store paths
    {3, 128},
    {2, 1, 9, 512},
    {2, 2048}
  ]

  for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
    test "cuda scaled_softmax matches the f64 reference for #{inspect(type)}" do
      TestRef.assert_softmax_matches(:cuda, unquote(Macro.escape(type)), @shapes)
    end
  end

  test "buffers stay on the device across calls and round-trip exactly" do
    bin = TestRef.encode(TestRef.random_list(4 * 60 * 60), {:f, 32})
    x = {bin, {1, 4, 60, 60}, {:f, 32}}
    buf = Buffer.upload(x)
    assert %Buffer{shape: {1, 4, 60, 60}, type: {:f, 32}} = buf
    assert Buffer.download(buf) == x
    on_device = ScaledSoftmax.native(buf, backend: :cuda, causal: true, out: :device)
    assert %Buffer{} = on_device
    assert Buffer.download(on_device) == ScaledSoftmax.native(x, backend: :cuda, causal: true)
    # A buffer can feed the CPU backend too (downloaded for the call).
    {cpu, _, _} = ScaledSoftmax.native(buf, backend: :cpu, causal: true)
    {gpu, _, _} = Buffer.download(on_device)
    assert TestRef.rel_l2(TestRef.decode(gpu, {:f, 32}), TestRef.decode(cpu, {:f, 32})) < 1.0e-6
  end

  test "GPU memory returns to its baseline after 10,000 buffer allocate/free cycles" do
    one_mib = {:binary.copy(<<1.0::float-32-native>>, 262_144), {512, 512}, {:f, 32}}

    # Each round runs in its own process: when it exits, the last references it held are
    # gone too, so everything it allocated is garbage.
    cycles = fn n ->
      Task.async(fn ->
        for i <- 1..n do
          {:ok, _ref} = Native.buffer_upload(one_mib, nil)
          if rem(i, 500) == 0, do: :erlang.garbage_collect()
        end

        :ok
      end)
      |> Task.await(120_000)

      :erlang.garbage_collect()
    end

    # One short round first, so one-time allocations (pool, staging) are in the baseline.
    cycles.(500)
    {:ok, {free0, _total}} = Native.cuda_mem_info(nil)
    cycles.(10_000)
    {:ok, {free1, _}} = Native.cuda_mem_info(nil)
    IO.puts("GPU free memory before #{free0}, after 10,000 cycles #{free1}")
    assert abs(free0 - free1) <= 64 * 1024 * 1024
  end

  test "a kernel compiled in one OS process is loaded from the disk cache by the next" do
    dir = Path.join(System.tmp_dir!(), "fk-cache-#{System.unique_integer([:positive])}")
    ebin = :code.lib_dir(:fused_kernels) |> Path.join("ebin")
    elixir = System.find_executable("elixir")

    script = """
    x = {<<1.0::float-32-native, 2.0::float-32-native>>, {1, 2}, {:f, 32}}
    FusedKernels.ScaledSoftmax.native(x, backend: :cuda)
    %{kernel_cache: c} = FusedKernels.info()
    IO.puts("compiles=\#{c.compiles} disk_hits=\#{c.disk_hits}")
    """

    run = fn ->
      System.cmd(elixir, ["-pa", ebin, "-e", script],
        env: [{"FUSED_KERNELS_CACHE_DIR", dir}],
        stderr_to_stdout: true
      )
    end

    {first, 0} = run.()
    {second, 0} = run.()
    IO.puts("first process:\n#{first}second process:\n#{second}")
    assert first =~ ~r/\[fused_kernels\] compiled scaled_softmax_\w+ \(scaled_softmax\.cu\)/
    assert first =~ "compiles=1 disk_hits=0"
    refute second =~ "[fused_kernels] compiled"
    assert second =~ "compiles=0 disk_hits=1"
    File.rm_rf!(dir)
  end

  test "CUDA errors come back as error tuples, not crashes" do
    huge = {<<0::32>>, {1, 1}, {:f, 32}}
    assert {:error, {:argument, msg}} = Native.buffer_upload(huge, 1_000)
    assert msg =~ "device 1000 does not exist"

    assert {:error, {:argument, _}} =
             Native.scaled_softmax(%{x: {<<0::64>>, {1, 1}, {:f, 64}}}, %{
               scale: 1.0,
               causal: false,
               backend: :cuda,
               out: :host
             })
  end
end
