// Tenant: own usage over the last 30 days.

import { api } from "../lib/api.js";
import { addDays, utcDay } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { showUsage } from "../lib/usage_view.js";

const DAYS = 30;

if (startPage("tenant")) {
  const start = utcDay(-(DAYS - 1));
  const end = utcDay(0);
  showUsage({
    start,
    end,
    fetchReport: (groupBy) =>
      api("/v1/usage", { query: { start, end: addDays(end, 1), group_by: groupBy } }),
  });
}
