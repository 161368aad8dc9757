/* The producer's per-record path in C: logbus.api._fastsend.

   Producer.send() in Python costs about 1.5 us a record on the machines we
   measure on, most of it the interpreter's per-line cost; a record kept by the
   caller as a RecordFuture costs another 0.7 us in CPython's cyclic garbage
   collector, which walks every tracked object of the process again each time
   enough of them have survived (perf/RESULTS.md, "The per-record producer
   path"). This module does the common case of send() (no headers, bytes or
   None for key and value, a topic whose limits the producer has, a batch open
   for the partition with room for the record) without the interpreter, and
   hands every other case to the Python send() unchanged, which stays the
   reference: both paths append to the same batches under the producer's lock.
   Those batches keep their records as Arrow buffers (Columns, below), which
   the sender thread frames without a conversion per record.

   The RecordFuture it returns is not tracked by the cyclic collector: until
   it is asked for a Future's own state or given an attribute (RecordFuture
   calls track() first), it refers only to its batch and two ints, so a cycle
   through it must pass through its batch. The batch refers to its futures
   only through callbacks, which it drops once done, and it hands each caller
   a copy of its error, never the error it keeps (logbus.errors.copy_error), so no
   traceback of a caller's frames is reachable from it. (CPython untracks
   tuples whose items cannot form cycles the same way.) Its reference count
   frees it.

   Built by pip at install (setup.py, optional): without a compiler logbus
   runs the pure-Python path, which is the same behaviour.

   Python 3.11 only (as logbus): the slot offsets come from the classes'
   member descriptors. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

#define RECORD_OVERHEAD_BYTES 20 /* logbus.api.producer.RECORD_OVERHEAD_BYTES: checked at set-up */
#define ARGS_MAX 6                /* topic, value, key, headers, partition, timestamp_ms */

static PyObject *str_closed, *str_buffered, *str_buffer_memory, *str_batch_size, *str_close_batch;
static PyObject *arg_names[ARGS_MAX];


/* --- Columns: a batch's records as the Arrow buffers they are framed from ----------------------------

   A batch of a producer with the C path keeps its records' keys, values and timestamps here, copied
   in as each record is added (the bytes are in the CPU's cache then), instead of in three lists of
   Python objects that the sender thread turned into Arrow arrays record by record when it framed the
   batch: building those arrays was the largest part of the sender's time (perf/RESULTS.md). The
   buffers are Arrow's binary and int64 layouts: validity bitmaps (least significant bit first),
   int32 offsets, data. Not thread-safe by itself: the producer adds records under its lock, and the
   sender takes the buffers after the batch left the open batches. */

typedef struct {
    char *data;
    Py_ssize_t size, capacity;
} Buf;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count, null_values, null_keys;
    long long first_timestamp, max_timestamp;
    Buf value_data, value_offsets, value_valid, key_data, key_offsets, key_valid, timestamps;
} Columns;

static PyTypeObject ColumnsType;

static int
buf_reserve(Buf *buf, Py_ssize_t extra)
{
    if (buf->size + extra <= buf->capacity)
        return 0;
    Py_ssize_t capacity = buf->capacity ? buf->capacity : 256;
    while (capacity < buf->size + extra) {
        if (capacity > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        capacity *= 2;
    }
    char *data = PyMem_Realloc(buf->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buf->data = data;
    buf->capacity = capacity;
    return 0;
}

static void
buf_put(Buf *buf, const void *bytes, Py_ssize_t size)
{
    memcpy(buf->data + buf->size, bytes, size);
    buf->size += size;
}

/* Add one record (value and key: bytes or None); its index in the batch, or -1 with an error set and
   nothing added. */
static Py_ssize_t
columns_add(Columns *self, PyObject *value, PyObject *key, long long timestamp_ms)
{
    Py_ssize_t value_size = value == Py_None ? 0 : PyBytes_GET_SIZE(value);
    Py_ssize_t key_size = key == Py_None ? 0 : PyBytes_GET_SIZE(key);
    if (self->value_data.size + value_size > INT32_MAX || self->key_data.size + key_size > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a batch holds at most 2 GiB of keys and of values");
        return -1;
    }
    int new_bitmap_byte = self->count % 8 == 0;
    if (buf_reserve(&self->value_data, value_size) < 0 || buf_reserve(&self->key_data, key_size) < 0
        || buf_reserve(&self->value_offsets, 4) < 0 || buf_reserve(&self->key_offsets, 4) < 0
        || buf_reserve(&self->timestamps, 8) < 0 || buf_reserve(&self->value_valid, 1) < 0
        || buf_reserve(&self->key_valid, 1) < 0)
        return -1;
    Py_ssize_t index = self->count;
    if (new_bitmap_byte) {
        self->value_valid.data[self->value_valid.size++] = 0;
        self->key_valid.data[self->key_valid.size++] = 0;
    }
    char bit = (char)(1 << (index % 8));
    if (value == Py_None)
        self->null_values++;
    else {
        buf_put(&self->value_data, PyBytes_AS_STRING(value), value_size);
        self->value_valid.data[index / 8] |= bit;
    }
    if (key == Py_None)
        self->null_keys++;
    else {
        buf_put(&self->key_data, PyBytes_AS_STRING(key), key_size);
        self->key_valid.data[index / 8] |= bit;
    }
    int32_t value_end = (int32_t)self->value_data.size, key_end = (int32_t)self->key_data.size;
    int64_t timestamp = timestamp_ms;
    buf_put(&self->value_offsets, &value_end, 4);
    buf_put(&self->key_offsets, &key_end, 4);
    buf_put(&self->timestamps, &timestamp, 8);
    if (index == 0)
        self->first_timestamp = self->max_timestamp = timestamp_ms;
    else if (timestamp_ms > self->max_timestamp)
        self->max_timestamp = timestamp_ms;
    self->count++;
    return index;
}

static PyObject *
columns_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Columns() takes no arguments");
        return NULL;
    }
    Columns *self = (Columns *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    int32_t zero = 0;
    if (buf_reserve(&self->value_offsets, 4) < 0 || buf_reserve(&self->key_offsets, 4) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    buf_put(&self->value_offsets, &zero, 4);
    buf_put(&self->key_offsets, &zero, 4);
    return (PyObject *)self;
}

static void
columns_dealloc(Columns *self)
{
    Buf *bufs[] = {&self->value_data, &self->value_offsets, &self->value_valid, &self->key_data,
                   &self->key_offsets, &self->key_valid, &self->timestamps};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        PyMem_Free(bufs[i]->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
columns_append(Columns *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "append(value, key, timestamp_ms) takes 3 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *value = args[0], *key = args[1];
    if ((value != Py_None && !PyBytes_CheckExact(value)) || (key != Py_None && !PyBytes_CheckExact(key))) {
        PyErr_SetString(PyExc_TypeError, "a record's value and key must be bytes or None");
        return NULL;
    }
    long long timestamp_ms = PyLong_AsLongLong(args[2]);
    if (timestamp_ms == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t index = columns_add(self, value, key, timestamp_ms);
    return index < 0 ? NULL : PyLong_FromSsize_t(index);
}

static PyObject *
bytes_of(Buf *buf)
{
    return PyBytes_FromStringAndSize(buf->data, buf->size);
}

/* (count, first timestamp, largest timestamp, values, keys, timestamps): values and keys as
   (null count, validity bitmap or None when there is no null, offsets, data), each buffer as bytes. */
static PyObject *
columns_buffers(Columns *self, PyObject *unused)
{
    PyObject *value_valid = self->null_values ? bytes_of(&self->value_valid) : Py_NewRef(Py_None);
    PyObject *key_valid = self->null_keys ? bytes_of(&self->key_valid) : Py_NewRef(Py_None);
    PyObject *values = value_valid == NULL ? NULL : Py_BuildValue(
        "(nNNN)", self->null_values, value_valid, bytes_of(&self->value_offsets), bytes_of(&self->value_data));
    PyObject *keys = key_valid == NULL ? NULL : Py_BuildValue(
        "(nNNN)", self->null_keys, key_valid, bytes_of(&self->key_offsets), bytes_of(&self->key_data));
    if (values == NULL || keys == NULL) {
        Py_XDECREF(values);
        Py_XDECREF(keys);
        return NULL;
    }
    return Py_BuildValue("(nLLNNN)", self->count, self->first_timestamp, self->max_timestamp, values, keys,
                         bytes_of(&self->timestamps));
}

static Py_ssize_t
columns_length(Columns *self)
{
    return self->count;
}

static PyMethodDef columns_methods[] = {
    {"append", (PyCFunction)(void (*)(void))columns_append, METH_FASTCALL,
     PyDoc_STR("append(value, key, timestamp_ms) -> index: add one record (bytes or None, bytes or None, int).")},
    {"buffers", (PyCFunction)columns_buffers, METH_NOARGS,
     PyDoc_STR("buffers() -> (count, first timestamp, largest timestamp, values, keys, timestamps): values and keys "
               "as (null count, validity bitmap or None, int32 offsets, data), as bytes.")},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef columns_members[] = {
    {"null_keys", T_PYSSIZET, offsetof(Columns, null_keys), READONLY, PyDoc_STR("records without a key")},
    {"null_values", T_PYSSIZET, offsetof(Columns, null_values), READONLY, PyDoc_STR("records without a value")},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods columns_as_sequence = {
    .sq_length = (lenfunc)columns_length,
};

static PyTypeObject ColumnsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logbus.api._fastsend.Columns",
    .tp_doc = PyDoc_STR("Columns(): a batch's keys, values and timestamps as Arrow buffers, added record by record."),
    .tp_basicsize = sizeof(Columns),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = columns_new,
    .tp_dealloc = (destructor)columns_dealloc,
    .tp_methods = columns_methods,
    .tp_members = columns_members,
    .tp_as_sequence = &columns_as_sequence,
};

/* librdkafka's rd_kafka_msg_partitioner_murmur2 (rdkafka.h), which confluent_kafka.murmur2 calls: the
   topic and the opaque pointers are not used. */
typedef int32_t (*partitioner_fn)(const void *topic, const void *key, size_t key_size, int32_t partitions,
                                  void *topic_opaque, void *message_opaque);

/* --- FastSend: send()'s common case ------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *producer;   /* the Producer */
    PyObject *slow;       /* Producer.send bound to it: the reference path */
    PyObject *attrs;      /* the producer's __dict__ */
    PyObject *limits;     /* producer._limits: topic -> (partitions, record limit, max.message.bytes, batch limit) */
    PyObject *open;       /* producer._open: (topic, partition) -> _Batch */
    PyObject *sticky;     /* producer._sticky: topic -> partition of keyless records */
    PyObject *acquire;    /* producer._lock.acquire */
    PyObject *release;    /* producer._lock.release */
    PyObject *murmur2;    /* confluent_kafka.murmur2 */
    partitioner_fn partitioner;  /* librdkafka's murmur2 partitioner, the same function without Python's call, or NULL */
    PyTypeObject *future_type;  /* RecordFuture */
    PyTypeObject *batch_type;   /* _Batch */
    Py_ssize_t f_batch, f_index, f_timestamp;  /* RecordFuture's slots */
    Py_ssize_t b_columns, b_headers, b_size;  /* _Batch's slots */
    PyObject *last_timestamp;  /* the int of the last record's timestamp, and its value */
    long long last_timestamp_ms;
} FastSend;

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

static int
slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *offset)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL)
        return -1;
    if (Py_TYPE(descr) != &PyMemberDescr_Type || ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
        Py_DECREF(descr);
        return -1;
    }
    *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    return 0;
}

/* The reference path, with the caller's arguments as they came. */
static PyObject *
slow_path(FastSend *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

/* Milliseconds since the epoch, as time.time_ns() // 1_000_000 gives them. */
static long long
now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static PyObject *
fastsend_call(FastSend *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *given[ARGS_MAX] = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (self->producer == NULL) {  /* cleared by the garbage collector (a finalizer running late) */
        PyErr_SetString(PyExc_ReferenceError, "the producer of this send() is gone");
        return NULL;
    }
    if (nargs < 1 || nargs > ARGS_MAX)
        return slow_path(self, args, nargsf, kwnames);
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nkw; k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k);
            int found = -1;
            for (int j = 1; j < ARGS_MAX && found < 0; j++)
                if (name == arg_names[j])
                    found = j;
            for (int j = 1; j < ARGS_MAX && found < 0; j++)
                if (PyUnicode_Check(name) && PyUnicode_Compare(name, arg_names[j]) == 0)
                    found = j;
            if (found < 0 || given[found] != NULL)  /* topic by name, an unknown name, or one given twice */
                return slow_path(self, args, nargsf, kwnames);
            given[found] = args[nargs + k];
        }
    }
    PyObject *topic = given[0];
    PyObject *value = given[1] == NULL ? Py_None : given[1];
    PyObject *key = given[2] == NULL ? Py_None : given[2];
    PyObject *partition_arg = given[4] == NULL ? Py_None : given[4];
    PyObject *timestamp_arg = given[5] == NULL ? Py_None : given[5];
    if ((given[3] != NULL && given[3] != Py_None) || !PyUnicode_CheckExact(topic)
        || (value != Py_None && !PyBytes_CheckExact(value)) || (key != Py_None && !PyBytes_CheckExact(key)))
        return slow_path(self, args, nargsf, kwnames);
    PyObject *closed = PyDict_GetItemWithError(self->attrs, str_closed);
    if (closed != Py_False)
        return PyErr_Occurred() ? NULL : slow_path(self, args, nargsf, kwnames);
    PyObject *limits = PyDict_GetItemWithError(self->limits, topic);
    if (limits == NULL || !PyTuple_CheckExact(limits) || PyTuple_GET_SIZE(limits) != 4)
        return PyErr_Occurred() ? NULL : slow_path(self, args, nargsf, kwnames);
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(limits, 0));
    long long record_limit = PyLong_AsLongLong(PyTuple_GET_ITEM(limits, 1));
    long long batch_limit = PyLong_AsLongLong(PyTuple_GET_ITEM(limits, 3));
    if (PyErr_Occurred())
        return NULL;
    long long size = RECORD_OVERHEAD_BYTES;
    if (value != Py_None)
        size += PyBytes_GET_SIZE(value);
    if (key != Py_None)
        size += PyBytes_GET_SIZE(key);
    if (size > record_limit)
        return slow_path(self, args, nargsf, kwnames);  /* it raises RecordTooLargeError */

    long long partition;
    if (partition_arg == Py_None) {
        if (key != Py_None) {
            if (self->partitioner != NULL && count > 0 && count <= INT32_MAX)
                partition = self->partitioner(NULL, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), (int32_t)count,
                                              NULL, NULL);
            else {
                /* (the count is held: the limits tuple is borrowed, and the call could let another thread run) */
                PyObject *count_obj = PyTuple_GET_ITEM(limits, 0);
                Py_INCREF(count_obj);
                PyObject *call_args[2] = {key, count_obj};
                PyObject *hashed = PyObject_Vectorcall(self->murmur2, call_args, 2, NULL);
                Py_DECREF(count_obj);
                if (hashed == NULL)
                    return NULL;
                partition = PyLong_AsLongLong(hashed);
                Py_DECREF(hashed);
                if (partition == -1 && PyErr_Occurred())
                    return NULL;
            }
        }
        else {
            PyObject *sticky = PyDict_GetItemWithError(self->sticky, topic);
            if (sticky == NULL || !PyLong_CheckExact(sticky))
                return PyErr_Occurred() ? NULL : slow_path(self, args, nargsf, kwnames);
            partition = PyLong_AsLongLong(sticky);
            if (partition >= count)  /* the topic grew or shrank: the reference path picks again */
                return slow_path(self, args, nargsf, kwnames);
        }
    }
    else {
        if (!PyLong_CheckExact(partition_arg))
            return slow_path(self, args, nargsf, kwnames);
        int overflow;
        partition = PyLong_AsLongLongAndOverflow(partition_arg, &overflow);
        if (overflow || partition < 0 || partition >= count)
            return slow_path(self, args, nargsf, kwnames);  /* it raises InvalidPartitionError */
    }
    long long timestamp_ms;
    if (timestamp_arg == Py_None)
        timestamp_ms = now_ms();
    else {
        if (!PyLong_CheckExact(timestamp_arg))
            return slow_path(self, args, nargsf, kwnames);
        int overflow;
        timestamp_ms = PyLong_AsLongLongAndOverflow(timestamp_arg, &overflow);
        if (overflow || timestamp_ms < 0)
            return slow_path(self, args, nargsf, kwnames);  /* it raises InvalidRecordError */
    }

    PyObject *index_obj = NULL, *timestamp_obj = NULL, *slot = NULL, *batch = NULL;
    PyObject *locked = PyObject_CallNoArgs(self->acquire);
    if (locked == NULL)
        return NULL;
    Py_DECREF(locked);
    PyObject *buffered_obj = PyDict_GetItemWithError(self->attrs, str_buffered);
    PyObject *buffer_memory_obj = PyDict_GetItemWithError(self->attrs, str_buffer_memory);
    PyObject *batch_size_obj = PyDict_GetItemWithError(self->attrs, str_batch_size);
    if (buffered_obj == NULL || buffer_memory_obj == NULL || batch_size_obj == NULL)
        goto unlock;
    long long buffered = PyLong_AsLongLong(buffered_obj);
    long long buffer_memory = PyLong_AsLongLong(buffer_memory_obj);
    long long batch_size = PyLong_AsLongLong(batch_size_obj);
    if (PyErr_Occurred() || buffered + size > buffer_memory)  /* a full buffer: the reference path waits */
        goto unlock;
    PyObject *partition_obj = PyLong_FromLongLong(partition);
    slot = partition_obj == NULL ? NULL : PyTuple_Pack(2, topic, partition_obj);
    Py_XDECREF(partition_obj);
    if (slot == NULL)
        goto unlock;
    PyObject *open_batch = PyDict_GetItemWithError(self->open, slot);
    if (open_batch == NULL || Py_TYPE(open_batch) != self->batch_type)
        goto unlock;  /* no batch open for the partition: the reference path opens one */
    Py_INCREF(open_batch);
    batch = open_batch;
    PyObject *columns = SLOT(batch, self->b_columns), *headers = SLOT(batch, self->b_headers);
    PyObject *size_obj = SLOT(batch, self->b_size);
    if (columns == NULL || headers == NULL || size_obj == NULL || Py_TYPE(columns) != &ColumnsType
        || (headers != Py_None && !PyList_CheckExact(headers)))
        goto unlock;
    long long batch_bytes = PyLong_AsLongLong(size_obj);
    if (PyErr_Occurred() || batch_bytes + size > batch_limit)
        goto unlock;  /* the batch is full: the reference path closes it and opens another */
    /* Records sent in the same millisecond share one int (about a thousand of them at 1M records/s). */
    if (self->last_timestamp == NULL || self->last_timestamp_ms != timestamp_ms) {
        PyObject *fresh = PyLong_FromLongLong(timestamp_ms);
        if (fresh != NULL) {
            Py_XSETREF(self->last_timestamp, fresh);
            self->last_timestamp_ms = timestamp_ms;
        }
    }
    timestamp_obj = Py_XNewRef(self->last_timestamp_ms == timestamp_ms ? self->last_timestamp : NULL);
    PyObject *new_size = PyLong_FromLongLong(batch_bytes + size);
    PyObject *new_buffered = PyLong_FromLongLong(buffered + size);
    Py_ssize_t index = -1;
    if (timestamp_obj == NULL || new_size == NULL || new_buffered == NULL
        || (index = columns_add((Columns *)columns, value, key, timestamp_ms)) < 0) {
        Py_XDECREF(new_size);
        Py_XDECREF(new_buffered);
        goto unlock;  /* nothing was added (columns_add adds all of a record or nothing) */
    }
    /* From here the record is in the batch: nothing may fail but for memory, after which the process
       is not worth saving. */
    index_obj = PyLong_FromSsize_t(index);
    if (index_obj == NULL || (headers != Py_None && PyList_Append(headers, Py_None) < 0))
        Py_FatalError("logbus: no memory to add a record to a batch");
    PyObject *old_size = SLOT(batch, self->b_size);
    SLOT(batch, self->b_size) = new_size;
    Py_DECREF(old_size);
    if (PyDict_SetItem(self->attrs, str_buffered, new_buffered) < 0)
        Py_FatalError("logbus: no memory to count a record in the producer's buffer");
    Py_DECREF(new_buffered);
    PyObject *closed_batch = Py_None;
    Py_INCREF(closed_batch);
    if (batch_bytes + size >= batch_size) {
        Py_DECREF(closed_batch);
        closed_batch = PyObject_CallMethodOneArg(self->producer, str_close_batch, slot);
    }
    /* (An error _close_batch raised waits while the lock is released: no call may be made with one set.) */
    PyObject *error_type, *error_value, *error_trace;
    PyErr_Fetch(&error_type, &error_value, &error_trace);
    PyObject *unlocked = PyObject_CallNoArgs(self->release);
    Py_DECREF(slot);
    if (unlocked == NULL) {
        Py_XDECREF(error_type);
        Py_XDECREF(error_value);
        Py_XDECREF(error_trace);
    }
    else {
        Py_DECREF(unlocked);
        PyErr_Restore(error_type, error_value, error_trace);
    }
    if (closed_batch == NULL || unlocked == NULL) {
        Py_XDECREF(closed_batch);
        Py_DECREF(batch);
        Py_DECREF(index_obj);
        Py_DECREF(timestamp_obj);
        return NULL;
    }
    Py_DECREF(closed_batch);

    /* Allocated as object.__new__ would, without its set-up of the instance's __dict__ values (which
       allocates): a RecordFuture's __dict__ is made on first use, if ever (the Future's own state). */
    PyObject *future = self->future_type->tp_alloc(self->future_type, 0);
    if (future == NULL) {
        Py_DECREF(batch);
        Py_DECREF(index_obj);
        Py_DECREF(timestamp_obj);
        return NULL;
    }
    SLOT(future, self->f_batch) = batch;  /* the references taken above pass to the future */
    SLOT(future, self->f_index) = index_obj;
    SLOT(future, self->f_timestamp) = timestamp_obj;
    PyObject_GC_UnTrack(future);
    return future;

unlock:
    {
        /* Nothing was added: release the lock, then raise what went wrong, or hand the record to
           the reference path. */
        PyObject *error_type, *error_value, *error_trace;
        PyErr_Fetch(&error_type, &error_value, &error_trace);
        PyObject *unlocked = PyObject_CallNoArgs(self->release);
        Py_XDECREF(slot);
        Py_XDECREF(batch);
        Py_XDECREF(index_obj);
        Py_XDECREF(timestamp_obj);
        if (unlocked == NULL) {
            Py_XDECREF(error_type);
            Py_XDECREF(error_value);
            Py_XDECREF(error_trace);
            return NULL;
        }
        Py_DECREF(unlocked);
        if (error_type != NULL) {
            PyErr_Restore(error_type, error_value, error_trace);
            return NULL;
        }
    }
    return slow_path(self, args, nargsf, kwnames);
}

static PyObject *
fastsend_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *producer, *slow, *murmur2, *future_type, *batch_type;
    unsigned long long partitioner = 0;
    static char *names[] = {"producer", "slow", "murmur2", "future_type", "batch_type", "partitioner", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!O!|K", names, &producer, &slow, &murmur2,
                                     &PyType_Type, &future_type, &PyType_Type, &batch_type, &partitioner))
        return NULL;
    FastSend *self = (FastSend *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = (vectorcallfunc)fastsend_call;
    self->partitioner = (partitioner_fn)(uintptr_t)partitioner;
    Py_INCREF(producer);
    self->producer = producer;
    Py_INCREF(slow);
    self->slow = slow;
    Py_INCREF(murmur2);
    self->murmur2 = murmur2;
    Py_INCREF(future_type);
    self->future_type = (PyTypeObject *)future_type;
    Py_INCREF(batch_type);
    self->batch_type = (PyTypeObject *)batch_type;
    PyObject *lock = NULL;
    if ((self->attrs = PyObject_GenericGetDict(producer, NULL)) == NULL
        || (self->limits = PyObject_GetAttrString(producer, "_limits")) == NULL
        || (self->open = PyObject_GetAttrString(producer, "_open")) == NULL
        || (self->sticky = PyObject_GetAttrString(producer, "_sticky")) == NULL
        || (lock = PyObject_GetAttrString(producer, "_lock")) == NULL
        || (self->acquire = PyObject_GetAttrString(lock, "acquire")) == NULL
        || (self->release = PyObject_GetAttrString(lock, "release")) == NULL)
        goto error;
    Py_CLEAR(lock);
    if (!PyDict_Check(self->limits) || !PyDict_Check(self->open) || !PyDict_Check(self->sticky)) {
        PyErr_SetString(PyExc_TypeError, "the producer's _limits, _open and _sticky must be dicts");
        goto error;
    }
    if (slot_offset(self->future_type, "_batch", &self->f_batch) < 0
        || slot_offset(self->future_type, "_index", &self->f_index) < 0
        || slot_offset(self->future_type, "_timestamp_ms", &self->f_timestamp) < 0
        || slot_offset(self->batch_type, "columns", &self->b_columns) < 0
        || slot_offset(self->batch_type, "headers", &self->b_headers) < 0
        || slot_offset(self->batch_type, "size_bytes", &self->b_size) < 0)
        goto error;
    return (PyObject *)self;
error:
    Py_XDECREF(lock);
    Py_DECREF(self);
    return NULL;
}

static int
fastsend_traverse(FastSend *self, visitproc visit, void *arg)
{
    Py_VISIT(self->producer);
    Py_VISIT(self->slow);
    Py_VISIT(self->attrs);
    Py_VISIT(self->limits);
    Py_VISIT(self->open);
    Py_VISIT(self->sticky);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->murmur2);
    Py_VISIT(self->future_type);
    Py_VISIT(self->batch_type);
    return 0;
}

static int
fastsend_clear(FastSend *self)
{
    Py_CLEAR(self->producer);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->attrs);
    Py_CLEAR(self->limits);
    Py_CLEAR(self->open);
    Py_CLEAR(self->sticky);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->murmur2);
    Py_CLEAR(self->future_type);
    Py_CLEAR(self->batch_type);
    Py_CLEAR(self->last_timestamp);
    return 0;
}

static void
fastsend_dealloc(FastSend *self)
{
    PyObject_GC_UnTrack(self);
    fastsend_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FastSendType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logbus.api._fastsend.FastSend",
    .tp_doc = PyDoc_STR("FastSend(producer, slow, murmur2, future_type, batch_type, partitioner=0): a producer's "
                        "send(), the common case in C and every other case by ``slow``; ``partitioner`` is the address "
                        "of librdkafka's rd_kafka_msg_partitioner_murmur2 (0: call ``murmur2``)."),
    .tp_basicsize = sizeof(FastSend),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(FastSend, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = fastsend_new,
    .tp_traverse = (traverseproc)fastsend_traverse,
    .tp_clear = (inquiry)fastsend_clear,
    .tp_dealloc = (destructor)fastsend_dealloc,
};

static PyObject *
track(PyObject *module, PyObject *obj)
{
    if (PyObject_IS_GC(obj) && !PyObject_GC_IsTracked(obj))
        PyObject_GC_Track(obj);
    Py_RETURN_NONE;
}

static PyObject *
murmur2_partition(PyObject *module, PyObject *args)
{
    unsigned long long address;
    Py_buffer key;
    int partitions;
    if (!PyArg_ParseTuple(args, "Ky*i:murmur2_partition", &address, &key, &partitions))
        return NULL;
    if (address == 0 || partitions <= 0) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "murmur2_partition needs a partitioner's address and at least one partition");
        return NULL;
    }
    int32_t partition = ((partitioner_fn)(uintptr_t)address)(NULL, key.buf, (size_t)key.len, partitions, NULL, NULL);
    PyBuffer_Release(&key);
    return PyLong_FromLong(partition);
}

static PyMethodDef methods[] = {
    {"murmur2_partition", murmur2_partition, METH_VARARGS,
     PyDoc_STR("murmur2_partition(address, key, partitions): the partition the C path picks for ``key`` through the "
               "partitioner at ``address`` (for tests).")},
    {"track", track, METH_O,
     PyDoc_STR("track(obj): have the cyclic garbage collector track ``obj`` again (a RecordFuture about to "
               "hold a Future's own state, which can refer back to it).")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "logbus.api._fastsend",
    PyDoc_STR("The producer's per-record path in C (see logbus.api.producer)."), -1, methods,
};

PyMODINIT_FUNC
PyInit__fastsend(void)
{
    static const char *names[ARGS_MAX] = {"topic", "value", "key", "headers", "partition", "timestamp_ms"};
    for (int i = 0; i < ARGS_MAX; i++)
        if ((arg_names[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    if ((str_closed = PyUnicode_InternFromString("_closed")) == NULL
        || (str_buffered = PyUnicode_InternFromString("_buffered_bytes")) == NULL
        || (str_buffer_memory = PyUnicode_InternFromString("buffer_memory_bytes")) == NULL
        || (str_batch_size = PyUnicode_InternFromString("batch_size_bytes")) == NULL
        || (str_close_batch = PyUnicode_InternFromString("_close_batch")) == NULL)
        return NULL;
    if (PyType_Ready(&FastSendType) < 0 || PyType_Ready(&ColumnsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FastSendType);
    Py_INCREF(&ColumnsType);
    if (PyModule_AddObject(m, "FastSend", (PyObject *)&FastSendType) < 0
        || PyModule_AddObject(m, "Columns", (PyObject *)&ColumnsType) < 0
        || PyModule_AddIntConstant(m, "RECORD_OVERHEAD_BYTES", RECORD_OVERHEAD_BYTES) < 0) {
        Py_DECREF(&FastSendType);
        Py_DECREF(&ColumnsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
