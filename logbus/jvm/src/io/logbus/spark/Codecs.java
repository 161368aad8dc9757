package io.logbus.spark;

import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.UncheckedIOException;

import com.github.luben.zstd.Zstd;
import org.apache.arrow.memory.ArrowBuf;
import org.apache.commons.compress.compressors.lz4.FramedLZ4CompressorInputStream;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.compression.AbstractCompressionCodec;
import org.apache.arrow.vector.compression.CompressionCodec;
import org.apache.arrow.vector.compression.CompressionUtil;
import org.apache.arrow.vector.compression.NoCompressionCodec;

/**
 * Arrow IPC body decompression (LZ4 frame, ZSTD) with the commons-compress and zstd-jni that Spark
 * ships, as Arrow's own arrow-compression module does it (that module is not among Spark's jars).
 * commons-compress, not lz4-java: Arrow C++ writes LZ4 frames of linked blocks, which lz4-java's
 * frame reader refuses. Readers only: logbus batches are compressed by the producer, in Python.
 */
final class Codecs implements CompressionCodec.Factory {
  static final Codecs INSTANCE = new Codecs();
  private static final long PREFIX = CompressionUtil.SIZE_OF_UNCOMPRESSED_LENGTH;

  @Override
  public CompressionCodec createCodec(CompressionUtil.CodecType type) {
    switch (type) {
      case LZ4_FRAME:
        return new Lz4();
      case ZSTD:
        return new ZstdCodec();
      default:
        return NoCompressionCodec.INSTANCE;
    }
  }

  private abstract static class Decompressor extends AbstractCompressionCodec {
    @Override
    protected ArrowBuf doCompress(BufferAllocator allocator, ArrowBuf uncompressed) {
      throw new UnsupportedOperationException("logbus's JVM reader does not compress");
    }
  }

  private static final class Lz4 extends Decompressor {
    @Override
    protected ArrowBuf doDecompress(BufferAllocator allocator, ArrowBuf compressed) {
      long length = readUncompressedLength(compressed);
      byte[] in = new byte[(int) (compressed.writerIndex() - PREFIX)];
      compressed.getBytes(PREFIX, in);
      byte[] out = new byte[(int) length];
      try (InputStream stream = new FramedLZ4CompressorInputStream(new ByteArrayInputStream(in))) {
        int read = 0;
        while (read < out.length) {
          int n = stream.read(out, read, out.length - read);
          if (n < 0) {
            throw new IOException("an LZ4 frame ended after " + read + " of " + out.length + " bytes");
          }
          read += n;
        }
      } catch (IOException e) {
        throw new UncheckedIOException(e);
      }
      ArrowBuf buffer = allocator.buffer(length);
      buffer.setBytes(0, out);
      buffer.writerIndex(length);
      return buffer;
    }

    @Override
    public CompressionUtil.CodecType getCodecType() {
      return CompressionUtil.CodecType.LZ4_FRAME;
    }
  }

  private static final class ZstdCodec extends Decompressor {
    @Override
    protected ArrowBuf doDecompress(BufferAllocator allocator, ArrowBuf compressed) {
      long length = readUncompressedLength(compressed);
      ArrowBuf buffer = allocator.buffer(length);
      long size =
          Zstd.decompressUnsafe(
              buffer.memoryAddress(), length, compressed.memoryAddress() + PREFIX, compressed.writerIndex() - PREFIX);
      if (Zstd.isError(size) || size != length) {
        buffer.close();
        throw new IllegalStateException("ZSTD: " + (Zstd.isError(size) ? Zstd.getErrorName(size) : size + " bytes, not " + length));
      }
      buffer.writerIndex(length);
      return buffer;
    }

    @Override
    public CompressionUtil.CodecType getCodecType() {
      return CompressionUtil.CodecType.ZSTD;
    }
  }
}
