"""logbus in a few lines: create a topic, produce, consume."""

import logbus
from logbus import TopicPartition

bus = logbus.connect(data_dir="logbus-data")  # starts a local Ray if none is running
if "greetings" not in bus.admin.list_topics():
    bus.admin.create_topic("greetings", partitions=2)

with logbus.Producer(bus) as producer:
    for i in range(10):
        future = producer.send("greetings", f"hello #{i}", key=f"user-{i % 3}")
    print("last record:", future.result())

consumer = logbus.Consumer(bus, auto_offset_reset="earliest")
consumer.assign([TopicPartition("greetings", 0), TopicPartition("greetings", 1)])
for tp, records in consumer.poll(timeout_ms=2000).items():
    for record in records:
        print(tp.partition, record.offset, record.key, record.value)

table = consumer.poll_arrow(timeout_ms=100)  # anything newer, as one Arrow table
print("more rows:", table.num_rows)
consumer.close()
