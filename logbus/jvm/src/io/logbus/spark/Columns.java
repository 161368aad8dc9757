package io.logbus.spark;

import org.apache.arrow.vector.BigIntVector;
import org.apache.arrow.vector.VarBinaryVector;
import org.apache.arrow.vector.VarCharVector;
import org.apache.arrow.vector.complex.MapVector;
import org.apache.arrow.vector.complex.StructVector;
import org.apache.spark.sql.types.ArrayType;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.Decimal;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarArray;
import org.apache.spark.sql.vectorized.ColumnarMap;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * Spark column vectors over one logbus batch's Arrow vectors, from row {@code first} on (a batch's first
 * and last rows may lie outside the range read), with no copy: Spark reads each value where Arrow put it.
 */
final class Columns {
  private Columns() {}

  /** What every read-only column here shares: the unsupported getters and nothing to close. */
  abstract static class ReadOnly extends ColumnVector {
    ReadOnly(DataType type) {
      super(type);
    }

    @Override
    public void close() {}

    @Override
    public boolean hasNull() {
      return numNulls() > 0;
    }

    @Override
    public int numNulls() {
      return 0;
    }

    @Override
    public boolean isNullAt(int rowId) {
      return false;
    }

    private UnsupportedOperationException unsupported() {
      return new UnsupportedOperationException(getClass().getSimpleName() + " of " + dataType().simpleString());
    }

    @Override
    public boolean getBoolean(int rowId) {
      throw unsupported();
    }

    @Override
    public byte getByte(int rowId) {
      throw unsupported();
    }

    @Override
    public short getShort(int rowId) {
      throw unsupported();
    }

    @Override
    public int getInt(int rowId) {
      throw unsupported();
    }

    @Override
    public long getLong(int rowId) {
      throw unsupported();
    }

    @Override
    public float getFloat(int rowId) {
      throw unsupported();
    }

    @Override
    public double getDouble(int rowId) {
      throw unsupported();
    }

    @Override
    public ColumnarArray getArray(int rowId) {
      throw unsupported();
    }

    @Override
    public ColumnarMap getMap(int ordinal) {
      throw unsupported();
    }

    @Override
    public Decimal getDecimal(int rowId, int precision, int scale) {
      throw unsupported();
    }

    @Override
    public UTF8String getUTF8String(int rowId) {
      throw unsupported();
    }

    @Override
    public byte[] getBinary(int rowId) {
      throw unsupported();
    }

    @Override
    public ColumnVector getChild(int ordinal) {
      throw unsupported();
    }
  }

  /** key or value: binary, null where the record has none. */
  static final class Binary extends ReadOnly {
    private final VarBinaryVector vector;
    private final int first;
    private final int rows;

    Binary(VarBinaryVector vector, int first, int rows) {
      super(DataTypes.BinaryType);
      this.vector = vector;
      this.first = first;
      this.rows = rows;
    }

    @Override
    public int numNulls() {
      if (vector.getNullCount() == 0) {
        return 0;
      }
      int nulls = 0;
      for (int i = 0; i < rows; i++) {
        nulls += vector.isNull(first + i) ? 1 : 0;
      }
      return nulls;
    }

    @Override
    public boolean isNullAt(int rowId) {
      return vector.isNull(first + rowId);
    }

    @Override
    public byte[] getBinary(int rowId) {
      return vector.getObject(first + rowId);
    }
  }

  /** A header's key. */
  static final class Text extends ReadOnly {
    private final VarCharVector vector;

    Text(VarCharVector vector) {
      super(DataTypes.StringType);
      this.vector = vector;
    }

    @Override
    public int numNulls() {
      return vector.getNullCount();
    }

    @Override
    public boolean isNullAt(int rowId) {
      return vector.isNull(rowId);
    }

    @Override
    public UTF8String getUTF8String(int rowId) {
      return vector.isNull(rowId) ? null : UTF8String.fromBytes(vector.get(rowId));
    }
  }

  /** The records' timestamps in Spark's microseconds; every record of a LogAppendTime batch has the batch's. */
  static final class Timestamps extends ReadOnly {
    private final BigIntVector vector;
    private final int first;
    private final long appendTimeMs;
    private final boolean logAppendTime;

    Timestamps(BigIntVector vector, int first, boolean logAppendTime, long appendTimeMs) {
      super(DataTypes.TimestampType);
      this.vector = vector;
      this.first = first;
      this.logAppendTime = logAppendTime;
      this.appendTimeMs = appendTimeMs;
    }

    @Override
    public boolean isNullAt(int rowId) {
      return !logAppendTime && vector.isNull(first + rowId);
    }

    @Override
    public int numNulls() {
      return logAppendTime ? 0 : vector.getNullCount();
    }

    @Override
    public long getLong(int rowId) {
      return (logAppendTime ? appendTimeMs : vector.get(first + rowId)) * 1000L;
    }
  }

  /** The records' offsets: {@code first + row} (a batch's records have consecutive offsets). */
  static final class Offsets extends ReadOnly {
    private final long first;

    Offsets(long first) {
      super(DataTypes.LongType);
      this.first = first;
    }

    @Override
    public long getLong(int rowId) {
      return first + rowId;
    }
  }

  /** headers: Arrow's map&lt;string, binary&gt; as the Kafka source's array&lt;struct&lt;key, value&gt;&gt;. */
  static final class Headers extends ReadOnly {
    private final MapVector vector;
    private final int first;
    private final Entries entries;

    Headers(MapVector vector, int first) {
      super(new ArrayType(KafkaSchema.HEADER, true));
      this.vector = vector;
      this.first = first;
      this.entries = new Entries((StructVector) vector.getDataVector());
    }

    @Override
    public int numNulls() {
      return vector.getNullCount();
    }

    @Override
    public boolean isNullAt(int rowId) {
      return vector.isNull(first + rowId);
    }

    @Override
    public ColumnarArray getArray(int rowId) {
      int row = first + rowId;
      int start = vector.getOffsetBuffer().getInt((long) row * 4);
      int end = vector.getOffsetBuffer().getInt((long) (row + 1) * 4);
      return new ColumnarArray(entries, start, end - start);
    }
  }

  /** The entries of all rows' headers: struct&lt;key string, value binary&gt;. */
  static final class Entries extends ReadOnly {
    private final StructVector vector;
    private final ColumnVector key;
    private final ColumnVector value;

    Entries(StructVector vector) {
      super(KafkaSchema.HEADER);
      this.vector = vector;
      this.key = new Text((VarCharVector) vector.getChildByOrdinal(0));
      this.value = new Binary((VarBinaryVector) vector.getChildByOrdinal(1), 0, vector.getValueCount());
    }

    @Override
    public boolean isNullAt(int rowId) {
      return vector.isNull(rowId);
    }

    @Override
    public ColumnVector getChild(int ordinal) {
      return ordinal == 0 ? key : value;
    }
  }
}
